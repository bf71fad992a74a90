"""Engine configuration: a TOML file with sections [model], [kv], [scheduler], [event_log],
[sandbox], [network], [server].

Every key has a default, so no file is needed for the default model. Unknown keys are errors.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs
import cattrs
from attrs import field, frozen
from cattrs.v import format_exception

DEFAULT_MODEL = "smollm2-135m"


def _choice(*allowed: str) -> Any:
    def check(_: object, attribute: attrs.Attribute, value: str) -> None:
        if value not in allowed and not (attribute.name == "device" and value.startswith("cuda:")):
            raise ValueError(f"{attribute.name} must be one of {', '.join(allowed)}, got {value!r}")

    return check


def _at_least(n: int) -> Any:
    def check(_: object, attribute: attrs.Attribute, value: int) -> None:
        if value < n:
            raise ValueError(f"{attribute.name} must be >= {n}, got {value}")

    return check


@frozen(kw_only=True)
class ModelConfig:
    path: str = DEFAULT_MODEL
    """The alias `smollm2-135m`, an HF model directory, or a .gguf file."""
    dtype: str = field(default="auto", validator=_choice("auto", "float32", "bfloat16", "float16"))
    """auto: float32 on the CPU, bfloat16 on CUDA."""
    device: str = field(default="auto", validator=_choice("auto", "cpu", "cuda"))


@frozen(kw_only=True)
class KvConfig:
    page_size: int = field(default=16, validator=_at_least(1))
    num_pages: int = field(default=0, validator=_at_least(0))
    """0 sizes the pool from memory_mb (CPU) or memory_fraction (CUDA)."""
    memory_mb: int = field(default=1024, validator=_at_least(1))
    memory_fraction: float = 0.5
    """Of the GPU memory still free after loading the model."""


@frozen(kw_only=True)
class SchedulerConfig:
    max_batch_tokens: int = field(default=512, validator=_at_least(1))
    max_batch_requests: int = field(default=64, validator=_at_least(1))
    fast_path: bool = True
    """Run inferlets' plain decodes on the driver thread (leases), without Trio round trips."""
    speculation_depth: int = field(default=1, validator=_at_least(0))
    """Passes staged ahead of a program on the fast path (0: none)."""


@frozen(kw_only=True)
class EventLogConfig:
    enabled: bool = True
    ring_size: int = field(default=100_000, validator=_at_least(0))
    path: str = ""
    """When set, every event is also appended to this JSON-lines file."""


@frozen(kw_only=True)
class SandboxConfig:
    budget_seconds: float = 300.0
    """Wall-clock time an inferlet may run, waiting included."""
    memory_mb: int = field(default=512, validator=_at_least(16))
    """Linear memory cap per inferlet (a Python inferlet needs about 13 MB to start)."""
    max_concurrent: int = field(default=64, validator=_at_least(1))
    """Inferlets running at once; more wait in the admission queue."""
    cache_dir: str = ""
    """Compiled components; empty means $PIE_CACHE_DIR/components or ~/.cache/pie/components."""
    scratch_dir: str = ""
    """When set, each inferlet gets scratch_dir/<instance> mounted at /scratch."""
    subscription_buffer: int = field(default=1024, validator=_at_least(1))
    """Messages a topic subscription holds before it drops (and reports an overrun)."""
    epoch_ms: float = 5.0
    """How often the runaway-guest check runs."""


def _policy_entries(_: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
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
    event_buffer: int = field(default=4096, validator=_at_least(1))
    """Events kept per inferlet for clients that re-attach."""
    send_buffer: int = field(default=8192, validator=_at_least(1))
    """Frames queued for one connection before it counts as too slow and is closed."""
    orphan_seconds: float = 600.0
    """An inferlet no connection is attached to for this long is terminated."""
    retain_seconds: float = 600.0
    """An ended inferlet's events stay readable by re-attaching for this long."""
    shutdown_seconds: float = 30.0
    """On SIGINT/SIGTERM, running inferlets get this long to finish before they are stopped."""


@frozen(kw_only=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    kv: KvConfig = KvConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    event_log: EventLogConfig = EventLogConfig()
    sandbox: SandboxConfig = SandboxConfig()
    network: NetworkConfig = NetworkConfig()
    server: ServerConfig = ServerConfig()


class ConfigError(ValueError):
    """A config file that could not be read; the message names the bad keys."""


_converter = cattrs.Converter(forbid_extra_keys=True)


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
