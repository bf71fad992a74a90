"""Compiled components by content hash: in memory, then on disk as `<sha256>-<crc32>.cwasm`
(milliseconds to load), compiling only what neither holds."""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import platform
import threading
import zlib
from pathlib import Path

from attrs import frozen
from wasmtime import Engine, WasmtimeError
from wasmtime.component import Component

from pie.sandbox.wasm import describe_error

log = logging.getLogger(__name__)

_WASM_MAGIC = b"\0asm"
_CORE_MODULE_VERSION = b"\x01\x00\x00\x00"


class InvalidProgram(Exception):
    """The bytes are not a WebAssembly component this engine can compile."""


def artifact_tag(config_tag: str = "") -> str:
    """Names the cache folder: artifacts of another wasmtime or machine are never read."""
    version = importlib.metadata.version("wasmtime")
    key = f"{version}|{platform.machine()}|{config_tag}"
    return f"wasmtime-{version}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@frozen(kw_only=True)
class CacheStatistics:
    loaded: int
    """Components compiled or read from disk and held in memory."""


class ComponentCache:
    def __init__(self, engine: Engine, directory: Path, *, config_tag: str = "") -> None:
        self.engine = engine
        self.directory = Path(directory) / artifact_tag(config_tag)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._loaded: dict[str, Component] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def load(self, wasm: bytes, digest: str | None = None) -> tuple[str, Component]:
        """The sha256 of `wasm` and its compiled component; raises InvalidProgram.

        `digest`, when the caller already knows it, saves hashing the bytes again.
        """
        digest = digest or hashlib.sha256(wasm).hexdigest()
        component = self._loaded.get(digest)
        if component is not None:
            return digest, component
        with self._lock_for(digest):
            component = self._loaded.get(digest) or self._read(digest)
            if component is None:
                component = _compile(self.engine, wasm)
                self._write(digest, component)
            self._loaded[digest] = component
        return digest, component

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(loaded=len(self._loaded))

    def _lock_for(self, digest: str) -> threading.Lock:
        # One compile per program even when several instances of it start at once.
        with self._guard:
            return self._locks.setdefault(digest, threading.Lock())

    def _read(self, digest: str) -> Component | None:
        for path in self.directory.glob(f"{digest}-*.cwasm"):
            try:
                if path.stem != _artifact_stem(digest, path.read_bytes()):
                    raise ValueError("checksum mismatch")
                return Component.deserialize_file(self.engine, str(path))
            except (OSError, ValueError, WasmtimeError) as exc:
                log.warning("recompiling %s: cached artifact unusable (%s)", digest[:12], exc)
                path.unlink(missing_ok=True)
        return None

    def _write(self, digest: str, component: Component) -> None:
        try:
            data = bytes(component.serialize())
            path = self.directory / f"{_artifact_stem(digest, data)}.cwasm"
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except (OSError, WasmtimeError) as exc:
            log.warning("could not cache %s: %s", digest[:12], exc)


def _artifact_stem(digest: str, data: bytes) -> str:
    # The checksum guards against truncated or damaged files, which wasmtime would trust.
    return f"{digest}-{zlib.crc32(data):08x}"


def _compile(engine: Engine, wasm: bytes) -> Component:
    if wasm.startswith(_WASM_MAGIC) and wasm[4:8] == _CORE_MODULE_VERSION:
        raise InvalidProgram(
            "this is a core WebAssembly module, not a component: build the program with "
            "componentize-py, or wrap it with `wasm-tools component new`"
        )
    try:
        return Component(engine, wasm)
    except WasmtimeError as exc:
        if wasm.startswith(_WASM_MAGIC):
            what = "not a valid WebAssembly component"
        else:
            what = "neither a WebAssembly binary (no \\0asm header) nor WebAssembly text"
        raise InvalidProgram(f"{what}: {describe_error(exc)}") from exc
