"""The config sections of what the engine reaches and serves: [network], [mcp], [server],
[http], [grammar], [metrics]."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import attrs
from attrs import field, frozen

from pie.config.checks import at_least, at_most, choice, positive


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
    max_redirects: int = field(default=5, validator=at_least(0))
    max_connections: int = field(default=64, validator=at_least(1))
    """Open connections kept by the engine's HTTP client, all inferlets together."""
    max_fetches_per_inferlet: int = field(default=8, validator=at_least(1))
    """Requests one inferlet may have in flight; more fail `busy` at once."""
    max_fetches_per_user: int = field(default=32, validator=at_least(1))
    """Requests one user's inferlets may have in flight together; more fail `busy` at once."""


_MCP_SERVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _mcp_server_name(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not _MCP_SERVER_NAME.fullmatch(value):
        raise ValueError(
            f"mcp server name must be letters, digits, '-', '_' and '.', got {value!r}"
        )


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
    timeout_seconds: float = field(default=30.0, validator=positive)
    """The longest a listing or a call may take (a call may ask for less)."""
    connect_seconds: float = field(default=30.0, validator=positive)
    """The longest a server may take to start and complete the MCP handshake."""
    retry_seconds: float = field(default=10.0, validator=at_least(0))
    """After a server fails to start, requests fail `unavailable` this long before another try."""
    max_result_mb: float = field(default=16.0, validator=positive)
    """The largest tool result (its content, as JSON) passed back to an inferlet."""


@frozen(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = field(default=8080, validator=[at_least(0), at_most(65535)])
    """0 picks a free port (the server prints the one it got)."""
    auth: str = field(default="auto", validator=choice("auto", "on", "off"))
    """auto: off when `host` is a loopback address, on otherwise."""
    users_dir: str = ""
    """Users and their credentials; empty means $PIE_CONFIG_DIR/users or ~/.config/pie/users."""
    max_frame_mb: int = field(default=16, validator=at_least(1))
    max_program_mb: int = field(default=256, validator=at_least(1))
    max_pending_upload_mb: int = field(default=512, validator=at_least(1))
    """Bytes the unfinished uploads of one connection may announce, all together."""
    max_pending_upload_mb_per_user: int = field(default=1024, validator=at_least(1))
    """Bytes the unfinished uploads of one user may announce, all connections together."""
    max_compiles: int = field(default=2, validator=at_least(1))
    """Uploaded programs compiled at once; more wait their turn."""
    max_compiles_per_user: int = field(default=1, validator=at_least(1))
    """Of those, how many one user's uploads may take; the user's others wait."""
    programs_dir: str = ""
    """Where installed programs and each user's names for them are kept across restarts; empty
    means `programs` beside the compiled components (see [sandbox] cache_dir)."""
    event_buffer: int = field(default=4096, validator=at_least(1))
    """Events kept per inferlet for clients that re-attach."""
    event_buffer_mb: float = field(default=32.0, validator=positive)
    """Bytes of those events kept per inferlet (messages count their text or data); the oldest
    go first, the final event always stays."""
    event_buffer_user_mb: float = field(default=128.0, validator=positive)
    """Bytes of buffered events kept for one user across all their inferlets, ended ones
    included, until `retain_seconds` forgets them."""
    send_buffer: int = field(default=8192, validator=at_least(1))
    """Frames queued for one connection before it counts as too slow and is closed."""
    orphan_seconds: float = 600.0
    """An inferlet no connection is attached to for this long is terminated."""
    retain_seconds: float = 600.0
    """An ended inferlet's events stay readable by re-attaching for this long."""
    shutdown_seconds: float = 30.0
    """On SIGINT/SIGTERM, running inferlets get this long to finish before they are stopped."""
    credential_check_seconds: float = field(default=2.0, validator=positive)
    """How often the credentials of open connections and streaming HTTP requests are read
    again: a removed user or a replaced token or key ends them within this."""
    login_seconds: float = field(default=10.0, validator=positive)
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

    port: int = field(default=-1, validator=[at_least(-1), at_most(65535)])
    """-1: no HTTP port; 0 picks a free one."""
    host: str = ""
    """Empty: the [server] host."""
    mounts: dict[str, str] = field(factory=dict, validator=_mounts)
    """Path prefix -> program (a name, name@version, content hash, .wasm file or folder)."""
    openai: bool = False
    """Mount the bundled `openai-server` inferlet at /v1 (the OpenAI-compatible API)."""
    max_body_mb: float = 16.0
    """Larger request bodies are answered 413."""
    openai_max_body_kb: int = field(default=1024, validator=at_least(1))
    """Larger bodies sent to the OpenAI-compatible API (with `openai`) are answered 400 with
    an OpenAI error (`request_too_large`) before any instance runs."""
    user: str = "http"
    """The user requests run for when the server needs no authentication."""


@frozen(kw_only=True)
class GrammarConfig:
    """Constrained decoding (the `grammar` interface, `response_format`, forced tool calls)."""

    max_source_kb: int = field(default=256, validator=at_least(1))
    """The largest grammar source (JSON schema, regex, Lark or EBNF) a program may compile."""
    cache_entries: int = field(default=256, validator=at_least(1))
    """Compiled grammars kept per model for reuse, the least recently used dropped first."""
    max_matchers_per_inferlet: int = field(default=64, validator=at_least(1))
    """Matchers (and, separately, grammar handles) one inferlet may hold at once."""
    max_matchers_per_user: int = field(default=1024, validator=at_least(1))
    """Matchers one user's inferlets may hold together."""


@frozen(kw_only=True)
class MetricsConfig:
    """The Prometheus endpoint `/metrics` and the probes `/health` and `/ready`
    (docs/observability.md), served by the HTTP front or on a port of their own."""

    public: bool = False
    """Serve /metrics without credentials even when the server requires them (/health and
    /ready always are)."""
    port: int = field(default=-1, validator=at_least(-1))
    """A port serving only /metrics, /health and /ready, for a server without an HTTP front
    (-1: none; 0 picks a free one; with [http] port set they are served there instead)."""
    min_scrape_ms: int = field(default=1000, validator=at_least(0))
    """A scrape this soon after the last one is answered with that one's text, so that a flood
    of scrapes costs the engine one scrape per interval."""
