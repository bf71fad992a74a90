"""Which program serves which HTTP path prefix, and getting mounted programs ready: a .wasm
file or an inferlet folder is installed (a folder built first) in the shared namespace when the
server starts; a name or name@version is looked up there once they all are, and every mount
then names its program by content hash, so no user's upload can take a mount's place."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from pie.actors.inferlet.programs import ProgramError
from pie.build import SDK, cached_build
from pie.config import HttpConfig, default_cache_dir

if TYPE_CHECKING:
    from pie.engine import Engine

_HASH = re.compile(r"^[0-9a-f]{64}$")
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
    installed = {prefix: _install(engine, value) for prefix, value in wanted.items()}
    return Mounts({prefix: _shared_hash(engine, ref) for prefix, ref in installed.items()})


def _shared_hash(engine: Engine, reference: str) -> str:
    if _HASH.match(reference):
        return reference  # exact bytes, whoever installs them
    try:
        return engine.programs.resolve(reference).info.hash
    except ProgramError as err:
        raise ProgramError(
            f"http.mounts: {err} in the shared namespace (mount a .wasm file or an inferlet "
            "folder, or a content hash)"
        ) from None


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
    info = engine.programs.add(wasm, name=name)  # the operator's: the shared namespace
    engine.wasm.cache.load(wasm, info.hash)
    return info.hash
