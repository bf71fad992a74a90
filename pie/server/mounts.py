"""Which program serves which HTTP path prefix, and getting mounted programs ready: a .wasm
file or an inferlet folder is installed (a folder built first) when the server starts; a name,
name@version or hash is resolved at each request, so it may be installed later."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pie.build import SDK, cached_build
from pie.config import HttpConfig, default_cache_dir

if TYPE_CHECKING:
    from pie.engine import Engine

OPENAI_PREFIX = "/v1"
OPENAI_SERVER = SDK / "examples" / "openai-server"


class Mounts:
    def __init__(self, programs: dict[str, str]) -> None:
        self.programs = dict(programs)
        """Prefix -> program reference (name, name@version or content hash)."""
        self._longest_first = sorted(self.programs, key=len, reverse=True)

    def find(self, path: str) -> tuple[str, str] | None:
        """The program for `path` (the longest matching prefix wins) and the path below it."""
        for prefix in self._longest_first:
            if prefix == "/":
                return self.programs[prefix], path
            if path == prefix or path.startswith(prefix + "/"):
                return self.programs[prefix], path[len(prefix) :] or "/"
        return None


def prepare_mounts(engine: Engine, config: HttpConfig) -> Mounts:
    """Installs the programs `config` mounts from files; slow (builds and compiles): call it
    off the event loop."""
    wanted = dict(config.mounts)
    if config.openai:
        wanted.setdefault(OPENAI_PREFIX, str(OPENAI_SERVER))
    return Mounts({prefix: _install(engine, value) for prefix, value in wanted.items()})


def _install(engine: Engine, value: str) -> str:
    path = Path(value).expanduser()
    if path.is_dir():
        path = cached_build(path, default_cache_dir() / "inferlets")
        name = Path(value).name
    elif path.suffix == ".wasm" and path.is_file():
        name = path.stem
    else:
        return value
    wasm = path.read_bytes()
    info = engine.programs.add(wasm, name=name)
    engine.wasm.cache.load(wasm, info.hash)
    return info.hash
