"""Engine configuration: a TOML file with sections [model] (or [[models]]), [driver], [kv],
[scheduler], [event_log], [bus], [sandbox], [network], [mcp], [server], [http], [grammar],
[media], [dashboard], [tracing], [metrics], [cluster].

Every key has a default, so no file is needed for the default model. Unknown keys are errors.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import attrs
import cattrs
from attrs import frozen

from pie.config.cluster_section import ClusterConfig
from pie.config.dashboard_section import DashboardConfig
from pie.config.engine_sections import (
    DEFAULT_MODEL,
    BusConfig,
    DriverConfig,
    EventLogConfig,
    KvConfig,
    ModelConfig,
    SandboxConfig,
    SchedulerConfig,
)
from pie.config.errors import ConfigError, describe, unknown_tables
from pie.config.media_section import MediaConfig
from pie.config.service_sections import (
    GrammarConfig,
    HttpConfig,
    McpConfig,
    McpServerConfig,
    MetricsConfig,
    NetworkConfig,
    ServerConfig,
)
from pie.config.tracing_section import TracingConfig


def default_cache_dir() -> Path:
    """Where converted models, compiled components and built inferlets are kept:
    `$PIE_CACHE_DIR`, else ~/.cache/pie."""
    return Path(os.environ.get("PIE_CACHE_DIR") or Path.home() / ".cache" / "pie")


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
    grammar: GrammarConfig = GrammarConfig()
    media: MediaConfig = MediaConfig()
    dashboard: DashboardConfig = DashboardConfig()
    tracing: TracingConfig = TracingConfig()
    metrics: MetricsConfig = MetricsConfig()
    cluster: ClusterConfig = ClusterConfig()
    models: tuple[ModelConfig, ...] = ()
    """[[models]]: several models served side by side, the first the default (which `model`
    then is too); empty: [model] alone."""

    def __attrs_post_init__(self) -> None:
        named = [m.name for m in self.models if m.name]
        twice = sorted({n for n in named if named.count(n) > 1})
        if twice:
            raise ValueError(f"[[models]] names must differ: {twice} given more than once")
        parallel = [m.tensor_parallel for m in self.model_entries if m.tensor_parallel > 1]
        if parallel and self.driver.backend == "cuda":
            raise ValueError(
                f"model.tensor_parallel = {parallel[0]} runs on the torch driver, "
                "not [driver] backend = cuda"
            )
        if parallel and len(self.model_entries) > 1:
            raise ValueError("model.tensor_parallel applies to a single served model")
        shares = sum(m.kv_share for m in self.models)
        if shares > 1.0 + 1e-9:
            raise ValueError(f"[[models]] kv_share values add up to {shares:g}, over 1")

    @property
    def model_entries(self) -> tuple[ModelConfig, ...]:
        """The models to serve: the [[models]] entries, or [model] alone."""
        return self.models or (self.model,)

    def kv_shares(self) -> tuple[float, ...]:
        """Each entry's part of the KV budget: its kv_share, or an equal part of the rest."""
        entries = self.model_entries
        if len(entries) == 1:
            return (1.0,)
        given = sum(m.kv_share for m in entries)
        open_ = [m for m in entries if not m.kv_share]
        rest = (1.0 - given) / len(open_) if open_ else 0.0
        return tuple(m.kv_share or rest for m in entries)


_converter = cattrs.Converter(forbid_extra_keys=True)


def _integer(data: Any, _: Any) -> int:
    # cattrs alone would truncate 2.5 to 2 and parse "2": an integer key takes a TOML integer.
    if type(data) is not int:
        raise ValueError(f"expected an integer, got {data!r}")
    return data


def _number(data: Any, _: Any) -> float:
    if type(data) not in (int, float):
        raise ValueError(f"expected a number, got {data!r}")
    return float(data)


def _string(data: Any, _: Any) -> str:
    if not isinstance(data, str):
        raise ValueError(f"expected a string, got {data!r}")
    return data


def _boolean(data: Any, _: Any) -> bool:
    if not isinstance(data, bool):
        raise ValueError(f"expected true or false, got {data!r}")
    return data


for _scalar, _hook in ((int, _integer), (float, _number), (str, _string), (bool, _boolean)):
    _converter.register_structure_hook(_scalar, _hook)


def _list_of(kind: Any) -> None:
    """Structures `kind` (a tuple type) from a list only: a bare string would otherwise become
    a tuple of its characters."""
    structure = _converter.get_structure_hook(kind)

    def hook(data: Any, type_: Any) -> Any:
        if not isinstance(data, list | tuple):
            raise ValueError(f"expected a list, got {data!r}")
        return structure(data, type_)

    _converter.register_structure_hook_func(lambda type_: type_ == kind, hook)


_structure_mcp_server = _converter.get_structure_hook(McpServerConfig)


def _mcp_server(data: Any, type_: Any) -> McpServerConfig:
    # Said in an mcp server's own words, before the list check would say it more plainly.
    if isinstance(data, dict) and isinstance(data.get("command"), str):
        raise ValueError("an mcp server's command is a list: the program, then its arguments")
    return _structure_mcp_server(data, type_)


_converter.register_structure_hook(McpServerConfig, _mcp_server)
for _sequence in (tuple[str, ...], tuple[int, ...], tuple[McpServerConfig, ...]):
    _list_of(_sequence)
_list_of(tuple[ModelConfig, ...])


def config_from_dict(data: dict[str, Any]) -> EngineConfig:
    """The config that TOML-shaped `data` describes; ConfigError names every bad table and key."""
    if "model" in data and "models" in data:
        raise ConfigError("give the models as [[models]] entries or as [model], not both")
    unknown = unknown_tables(data, EngineConfig)
    if unknown:
        raise ConfigError("; ".join(unknown))
    try:
        config = _converter.structure(data, EngineConfig)
        # [model] is the first [[models]] entry: structured once, so a problem is told once.
        return attrs.evolve(config, model=config.models[0]) if config.models else config
    except cattrs.BaseValidationError as exc:
        raise ConfigError("; ".join(describe(exc))) from exc
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
    try:
        return config_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc.__cause__


def with_overrides(config: EngineConfig, **sections: dict[str, Any]) -> EngineConfig:
    """A copy with some keys replaced, e.g. with_overrides(c, model={"path": "x.gguf"});
    ConfigError names the table of a value its checks refuse."""
    changes = {}
    for name, values in sections.items():
        given = {k: v for k, v in values.items() if v is not None}
        try:
            changes[name] = attrs.evolve(getattr(config, name), **given)
        except ValueError as exc:
            raise ConfigError(f"[{name}] {exc}") from exc
    return attrs.evolve(config, **changes)


__all__ = [
    "DEFAULT_MODEL",
    "BusConfig",
    "ClusterConfig",
    "ConfigError",
    "DashboardConfig",
    "DriverConfig",
    "EngineConfig",
    "EventLogConfig",
    "GrammarConfig",
    "HttpConfig",
    "KvConfig",
    "McpConfig",
    "McpServerConfig",
    "MediaConfig",
    "MetricsConfig",
    "ModelConfig",
    "NetworkConfig",
    "SandboxConfig",
    "SchedulerConfig",
    "ServerConfig",
    "TracingConfig",
    "config_from_dict",
    "default_cache_dir",
    "load_config",
    "with_overrides",
]
