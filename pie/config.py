"""Engine configuration: a TOML file with sections [model], [driver], [kv], [scheduler],
[event_log], [bus], [sandbox], [network], [mcp], [server], [http].

Every key has a default, so no file is needed for the default model. Unknown keys are errors.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import cattrs
from attrs import field, frozen
from cattrs.v import format_exception

DEFAULT_MODEL = "smollm2-135m"


def default_cache_dir() -> Path:
    """Where converted models, compiled components and built inferlets are kept:
    `$PIE_CACHE_DIR`, else ~/.cache/pie."""
    return Path(os.environ.get("PIE_CACHE_DIR") or Path.home() / ".cache" / "pie")


def _choice(*allowed: str) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in allowed and not (attribute.name == "device" and value.startswith("cuda:")):
            raise ValueError(f"{attribute.name} must be one of {', '.join(allowed)}, got {value!r}")

    return check


def _at_least(n: int) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
        if value < n:
            raise ValueError(f"{attribute.name} must be >= {n}, got {value}")

    return check


def _share(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


@frozen(kw_only=True)
class ModelConfig:
    path: str = DEFAULT_MODEL
    """The alias `smollm2-135m`, an HF model directory, or a .gguf file."""
    dtype: str = field(default="auto", validator=_choice("auto", "float32", "bfloat16", "float16"))
    """auto: float32 on the CPU, bfloat16 on CUDA."""
    device: str = field(default="auto", validator=_choice("auto", "cpu", "cuda"))


@frozen(kw_only=True)
class DriverConfig:
    """Which driver runs the model, and how it shares the machine's cores with the engine's
    other threads."""

    threads: int = field(default=0, validator=_at_least(0))
    """torch's CPU threads; 0: the usable cores minus one (at least 1), leaving a core to the
    event loop, the pass loop's helper thread and the guests."""
    omp_wait_policy: str = field(default="passive", validator=_choice("passive", "active"))
    """OMP_WAIT_POLICY when the environment does not set it: passive threads sleep between
    parallel regions, active ones spin and hold their cores."""
    backend: str = field(default="auto", validator=_choice("auto", "torch", "cuda"))
    """Which driver runs the model: cuda (flashinfer's paged kernels and CUDA graphs; needs a
    GPU, the `cuda` extra and a bfloat16 or float16 model), torch (plain torch on any device),
    or auto: cuda where it can run, else torch. `pie doctor` says which and why."""
    cuda_graphs: bool = True
    """The cuda driver captures decode passes as CUDA graphs at start-up and replays them."""
    graph_batch_sizes: tuple[int, ...] = field(
        default=(), validator=attrs.validators.deep_iterable(_at_least(1))
    )
    """Decode batch sizes captured as graphs; a pass replays the smallest that holds it.
    Empty: 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, as far as
    [scheduler] max_batch_requests, which is always captured."""


@frozen(kw_only=True)
class KvConfig:
    page_size: int = field(default=16, validator=_at_least(1))
    num_pages: int = field(default=0, validator=_at_least(0))
    """0 sizes the pool from memory_mb (CPU) or memory_fraction (CUDA)."""
    memory_mb: int = field(default=1024, validator=_at_least(1))
    memory_fraction: float = 0.5
    """Of the GPU memory still free after loading the model."""
    prefix_cache: str = field(default="user", validator=_choice("off", "user", "global"))
    """Which contexts reuse each other's committed pages instead of computing them again: none,
    a user's own (so no program learns another user's prompts from how fast its pass ran), or
    every context's."""
    inferlet_page_share: float = field(default=0.5, validator=_share)
    """Of the pool, the pages one inferlet (or client) may hold; past it, out-of-pages."""
    user_page_share: float = field(default=0.75, validator=_share)
    """Of the pool, the pages all contexts of one user may hold; past it, out-of-pages."""
    snapshot_page_share: float = field(default=0.25, validator=_share)
    """Of the pool, the pages one user's named snapshots may hold; past it, snapshot-quota."""
    snapshots_dir: str = ""
    """Where named snapshots are kept so that they survive a restart or a kill (each user's
    records, rebuilt at start); empty keeps them in memory only. `pie serve` sets it, when
    empty, to `snapshots` beside the compiled components (see [sandbox] cache_dir)."""


@frozen(kw_only=True)
class SchedulerConfig:
    max_batch_tokens: int = field(default=512, validator=_at_least(1))
    max_batch_requests: int = field(default=64, validator=_at_least(1))
    decode_tokens: int = field(default=16, validator=_at_least(1))
    """Requests of at most this many tokens are served before prefill chunks in each pass."""
    fast_path: bool = True
    """Run inferlets' plain decodes on the driver thread (leases), without Trio round trips."""
    speculation_depth: int = field(default=1, validator=_at_least(0))
    """Passes staged ahead of a program on the fast path (0: none)."""
    max_slots_per_pass: int = field(default=512, validator=_at_least(1))
    """Sampling and probe slots one program's pass may have; more is refused as invalid."""
    max_probe_values: int = field(default=1 << 22, validator=_at_least(1))
    """Values one pass's slots may return together (a raw-logits row is the vocabulary, a
    distribution two per token); more is refused as invalid before the driver sees it."""


@frozen(kw_only=True)
class EventLogConfig:
    enabled: bool = True
    ring_size: int = field(default=100_000, validator=_at_least(0))
    path: str = ""
    """When set, every event is also appended to this JSON-lines file."""
    max_unwritten: int = field(default=100_000, validator=_at_least(1))
    """Records the file writer may fall behind by; past that, records are left out of the file
    (which marks the gap) until it catches up by half."""
    ring_payload_chars: int = field(default=256, validator=_at_least(0))
    """Of each text or bytes field of an event, what the in-memory ring keeps (0: all); the
    file keeps every event whole."""


@frozen(kw_only=True)
class BusConfig:
    """What the messaging bus holds for inferlets and clients (docs/inferlet-api.md#messaging)."""

    max_message_kb: int = field(default=1024, validator=_at_least(1))
    """A pushed or broadcast message's size in UTF-8; larger ones are refused too-large."""
    max_queue_messages: int = field(default=10_000, validator=_at_least(1))
    max_queue_mb: int = field(default=16, validator=_at_least(1))
    """Bytes of messages one queue holds until they are pulled; past that a push is overrun."""
    max_user_mb: int = field(default=64, validator=_at_least(1))
    """Bytes of messages one user's pushes hold on all queues; past that a push fails quota."""
    max_waiting_pulls: int = field(default=1024, validator=_at_least(1))
    """Pulls one inferlet or connection may have waiting at once, on all queues; past that a
    pull fails overrun."""


@frozen(kw_only=True)
class SandboxConfig:
    budget_seconds: float = 300.0
    """Wall-clock time an inferlet may run, waiting included."""
    memory_mb: int = field(default=512, validator=_at_least(16))
    """Linear memory cap per inferlet (a Python inferlet needs about 13 MB to start)."""
    max_concurrent: int = field(default=64, validator=_at_least(1))
    """Inferlets running at once; more wait in the admission queue."""
    guest_memory_mb: int = field(default=0, validator=_at_least(0))
    """Linear memory all running inferlets may reserve together: one is admitted only while
    its memory_mb fits in what is left (0: half of the machine's memory, at least memory_mb)."""
    max_inferlets_per_user: int = field(default=256, validator=_at_least(0))
    """Inferlets of one user running and queued together; more launches are refused (0: no
    limit)."""
    max_running_per_user: int = field(default=0, validator=_at_least(0))
    """Inferlets of one user running at once; more wait in the admission queue though slots are
    free (0: up to max_concurrent). A freed slot always goes to the waiting user with the fewest
    running, so the default lets one user use every idle slot without starving others."""
    max_children: int = field(default=64, validator=_at_least(0))
    """Children one inferlet may have running and queued at once (0: no limit)."""
    max_child_depth: int = field(default=8, validator=_at_least(0))
    """How many generations of children below an inferlet a client launched (0: none)."""
    cache_dir: str = ""
    """Compiled components; empty means $PIE_CACHE_DIR/components or ~/.cache/pie/components."""
    scratch_dir: str = ""
    """When set, each inferlet gets a fresh directory under it at /scratch, removed when it ends."""
    scratch_quota_mb: int = field(default=256, validator=_at_least(0))
    """Bytes one /scratch may hold (0: no limit)."""
    scratch_max_files: int = field(default=10_000, validator=_at_least(0))
    """Files and directories one /scratch may hold (0: no limit)."""
    persist_dir: str = ""
    """When set, each inferlet also gets persist_dir/<its user> at /data, kept across runs."""
    persist_quota_mb: int = field(default=64, validator=_at_least(0))
    """Bytes one user's /data may hold (0: no limit)."""
    persist_max_files: int = field(default=10_000, validator=_at_least(0))
    """Files and directories one user's /data may hold (0: no limit)."""
    files_check_ms: float = field(default=100.0, validator=_at_least(1))
    """How often running inferlets' /scratch and /data are measured against their quotas."""
    subscription_buffer: int = field(default=1024, validator=_at_least(1))
    """Messages a topic subscription holds; past that its oldest are dropped (and the subscriber
    told of it by an overrun)."""
    subscription_buffer_mb: int = field(default=16, validator=_at_least(1))
    """Bytes (UTF-8) of messages one subscription holds; past that its oldest are dropped."""
    subscription_buffer_inferlet_mb: int = field(default=64, validator=_at_least(1))
    """Bytes of messages all of one inferlet's subscriptions hold together; past that the
    oldest of its fullest subscription are dropped."""
    epoch_ms: float = 5.0
    """How often the runaway-guest check runs."""
    guest_niceness: int = field(default=10, validator=[_at_least(0), attrs.validators.le(19)])
    """Scheduling niceness of guest threads (0-19): above 0, busy guests yield the CPU to the
    engine's own threads, and to every other process on the machine."""

    def __attrs_post_init__(self) -> None:
        if 0 < self.guest_memory_mb < self.memory_mb:
            raise ValueError(
                f"guest_memory_mb ({self.guest_memory_mb}) must be 0 or at least memory_mb "
                f"({self.memory_mb}): no inferlet could ever be admitted"
            )

    @property
    def guest_memory_bytes(self) -> int:
        """The guests' memory budget in bytes, `guest_memory_mb` or, when 0, half of this
        machine's memory (never below one inferlet's cap)."""
        if self.guest_memory_mb:
            return self.guest_memory_mb << 20
        try:
            half = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        except (ValueError, OSError):
            half = 0
        return max(half, self.memory_mb << 20)


def _policy_entries(_: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    from pie.net.policy import NetworkPolicy, PolicyError

    try:
        if attribute.name == "allow":
            NetworkPolicy.parse(value)
        else:
            NetworkPolicy.parse((), value)
    except PolicyError as exc:
        raise ValueError(f"network.{attribute.name}: {exc}") from None


@frozen(kw_only=True)
class NetworkConfig:
    """Outgoing HTTP from inferlets (the `http` interface). Nothing is reachable by default."""

    allow: tuple[str, ...] = field(default=(), validator=_policy_entries)
    """Addresses, CIDR blocks, host names and `*.domain` patterns inferlets may reach."""
    deny: tuple[str, ...] = field(default=(), validator=_policy_entries)
    """Addresses and blocks never connected to, even when an allowed name resolves there."""
    timeout_seconds: float = 30.0
    """The longest a request may take, redirects included (a request may ask for less)."""
    max_response_mb: float = 16.0
    max_redirects: int = field(default=5, validator=_at_least(0))
    max_connections: int = field(default=64, validator=_at_least(1))
    """Open connections kept by the engine's HTTP client, all inferlets together."""
    max_fetches_per_inferlet: int = field(default=8, validator=_at_least(1))
    """Requests one inferlet may have in flight; more fail `busy` at once."""
    max_fetches_per_user: int = field(default=32, validator=_at_least(1))
    """Requests one user's inferlets may have in flight together; more fail `busy` at once."""


_MCP_SERVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _mcp_server_name(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not _MCP_SERVER_NAME.fullmatch(value):
        raise ValueError(
            f"mcp server name must be letters, digits, '-', '_' and '.', got {value!r}"
        )


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


@frozen(kw_only=True)
class McpServerConfig:
    """One MCP server: a command the engine starts and talks to over stdio, or a URL."""

    name: str = field(validator=_mcp_server_name)
    """What inferlets call it by."""
    command: tuple[str, ...] = ()
    """The program and its arguments (no shell)."""
    env: dict[str, str] = field(factory=dict)
    """Extra environment for `command`, which otherwise gets only HOME, LOGNAME, PATH, SHELL,
    TERM and USER from the engine's."""
    cwd: str = ""
    """Where `command` runs; empty: the engine's working directory."""
    url: str = ""
    """A streamable-HTTP endpoint (http or https)."""
    headers: dict[str, str] = field(factory=dict)
    """Sent with every request to `url` (an authorization header, say)."""
    users: tuple[str, ...] = ()
    """The users whose inferlets may use this server; empty: every user."""

    def __attrs_post_init__(self) -> None:
        where = f"mcp server {self.name!r}"
        if bool(self.command) == bool(self.url):
            raise ValueError(f"{where} needs one of command and url")
        if self.url:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{where}: url must be an http or https URL, got {self.url!r}")
            if self.env or self.cwd:
                raise ValueError(f"{where}: env and cwd go with command, not url")
        elif self.headers:
            raise ValueError(f"{where}: headers go with url, not command")


def _unique_names(
    _: object, attribute: attrs.Attribute[Any], value: tuple[McpServerConfig, ...]
) -> None:
    names = [server.name for server in value]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"mcp.servers: the name {name!r} is used twice")


@frozen(kw_only=True)
class McpConfig:
    """MCP servers whose tools inferlets may list and call (the `mcp` interface); none by
    default. Each server is started (or connected to) on first use."""

    servers: tuple[McpServerConfig, ...] = field(default=(), validator=_unique_names)
    timeout_seconds: float = field(default=30.0, validator=_positive)
    """The longest a listing or a call may take (a call may ask for less)."""
    connect_seconds: float = field(default=30.0, validator=_positive)
    """The longest a server may take to start and complete the MCP handshake."""
    retry_seconds: float = field(default=10.0, validator=_at_least(0))
    """After a server fails to start, requests fail `unavailable` this long before another try."""
    max_result_mb: float = field(default=16.0, validator=_positive)
    """The largest tool result (its content, as JSON) passed back to an inferlet."""


@frozen(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = field(default=8080, validator=_at_least(0))
    """0 picks a free port (the server prints the one it got)."""
    auth: str = field(default="auto", validator=_choice("auto", "on", "off"))
    """auto: off when `host` is a loopback address, on otherwise."""
    users_dir: str = ""
    """Users and their credentials; empty means $PIE_CONFIG_DIR/users or ~/.config/pie/users."""
    max_frame_mb: int = field(default=16, validator=_at_least(1))
    max_program_mb: int = field(default=256, validator=_at_least(1))
    max_pending_upload_mb: int = field(default=512, validator=_at_least(1))
    """Bytes the unfinished uploads of one connection may announce, all together."""
    max_pending_upload_mb_per_user: int = field(default=1024, validator=_at_least(1))
    """Bytes the unfinished uploads of one user may announce, all connections together."""
    max_compiles: int = field(default=2, validator=_at_least(1))
    """Uploaded programs compiled at once; more wait their turn."""
    max_compiles_per_user: int = field(default=1, validator=_at_least(1))
    """Of those, how many one user's uploads may take; the user's others wait."""
    programs_dir: str = ""
    """Where installed programs and each user's names for them are kept across restarts; empty
    means `programs` beside the compiled components (see [sandbox] cache_dir)."""
    event_buffer: int = field(default=4096, validator=_at_least(1))
    """Events kept per inferlet for clients that re-attach."""
    event_buffer_mb: float = field(default=32.0, validator=_positive)
    """Bytes of those events kept per inferlet (messages count their text or data); the oldest
    go first, the final event always stays."""
    event_buffer_user_mb: float = field(default=128.0, validator=_positive)
    """Bytes of buffered events kept for one user across all their inferlets, ended ones
    included, until `retain_seconds` forgets them."""
    send_buffer: int = field(default=8192, validator=_at_least(1))
    """Frames queued for one connection before it counts as too slow and is closed."""
    orphan_seconds: float = 600.0
    """An inferlet no connection is attached to for this long is terminated."""
    retain_seconds: float = 600.0
    """An ended inferlet's events stay readable by re-attaching for this long."""
    shutdown_seconds: float = 30.0
    """On SIGINT/SIGTERM, running inferlets get this long to finish before they are stopped."""
    credential_check_seconds: float = field(default=2.0, validator=_positive)
    """How often the credentials of open connections and streaming HTTP requests are read
    again: a removed user or a replaced token or key ends them within this."""
    login_seconds: float = field(default=10.0, validator=_positive)
    """When authentication is required, a connection not authenticated this long after it
    opened is closed (1008)."""


def _mounts(_: object, attribute: attrs.Attribute[Any], value: dict[str, str]) -> None:
    for prefix, program in value.items():
        if not prefix.startswith("/") or (prefix != "/" and prefix.endswith("/")):
            raise ValueError(
                f"http.mounts: a prefix starts with '/' and does not end with one: {prefix!r}"
            )
        if not program:
            raise ValueError(f"http.mounts: no program for {prefix!r}")


@frozen(kw_only=True)
class HttpConfig:
    """HTTP-served inferlets (`pie serve --http PORT`): each request to a mounted prefix runs
    in a fresh instance of the program mounted there."""

    port: int = field(default=-1, validator=_at_least(-1))
    """-1: no HTTP port; 0 picks a free one."""
    host: str = ""
    """Empty: the [server] host."""
    mounts: dict[str, str] = field(factory=dict, validator=_mounts)
    """Path prefix -> program (a name, name@version, content hash, .wasm file or folder)."""
    openai: bool = False
    """Mount the bundled `openai-server` inferlet at /v1 (the OpenAI-compatible API)."""
    max_body_mb: float = 16.0
    """Larger request bodies are answered 413."""
    openai_max_body_kb: int = field(default=1024, validator=_at_least(1))
    """Larger bodies sent to the OpenAI-compatible API (with `openai`) are answered 400 with
    an OpenAI error (`request_too_large`) before any instance runs."""
    user: str = "http"
    """The user requests run for when the server needs no authentication."""


@frozen(kw_only=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    driver: DriverConfig = DriverConfig()
    kv: KvConfig = KvConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    event_log: EventLogConfig = EventLogConfig()
    bus: BusConfig = BusConfig()
    sandbox: SandboxConfig = SandboxConfig()
    network: NetworkConfig = NetworkConfig()
    mcp: McpConfig = McpConfig()
    server: ServerConfig = ServerConfig()
    http: HttpConfig = HttpConfig()


class ConfigError(ValueError):
    """A config file that could not be read; the message names the bad keys."""


_converter = cattrs.Converter(forbid_extra_keys=True)


def _integer(data: Any, _: Any) -> int:
    # cattrs alone would truncate 2.5 to 2 and parse "2": an integer key takes a TOML integer.
    if type(data) is not int:
        raise ValueError(f"expected an integer, got {data!r}")
    return data


_converter.register_structure_hook(int, _integer)
_structure_mcp_server = _converter.get_structure_hook(McpServerConfig)


def _mcp_server(data: Any, type_: Any) -> McpServerConfig:
    # A bare string would otherwise become a tuple of its characters.
    if isinstance(data, dict) and isinstance(data.get("command"), str):
        raise ValueError("an mcp server's command is a list: the program, then its arguments")
    return _structure_mcp_server(data, type_)


_converter.register_structure_hook(McpServerConfig, _mcp_server)


def _describe(exc: BaseException, type_: Any) -> str:
    # Our validators say what is wrong in their own words; keep them.
    if type(exc) is ValueError:
        return str(exc)
    return format_exception(exc, type_)


def config_from_dict(data: dict[str, Any]) -> EngineConfig:
    try:
        return _converter.structure(data, EngineConfig)
    except cattrs.BaseValidationError as exc:
        messages = cattrs.transform_error(exc, format_exception=_describe)
        raise ConfigError("; ".join(messages)) from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc


def load_config(path: str | Path | None = None) -> EngineConfig:
    """The config in `path` (TOML), or the defaults when `path` is None."""
    if path is None:
        return EngineConfig()
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    return config_from_dict(data)


def with_overrides(config: EngineConfig, **sections: dict[str, Any]) -> EngineConfig:
    """A copy with some keys replaced, e.g. with_overrides(c, model={"path": "x.gguf"})."""
    changes = {
        name: attrs.evolve(
            getattr(config, name), **{k: v for k, v in values.items() if v is not None}
        )
        for name, values in sections.items()
    }
    return attrs.evolve(config, **changes)
