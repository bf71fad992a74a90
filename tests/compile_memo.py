"""One compile per test guest per run: engines in tests mostly keep their components in fresh
temporary folders, and a Python guest takes 8 to 9 seconds to compile on a 2-core machine. This
keeps every compiled component of the run by content hash and hands engines a deserialized copy
(milliseconds), so only the first engine that loads a guest compiles it."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from wasmtime import Engine, WasmtimeError
from wasmtime.component import Component

import pie.sandbox.cache as component_cache


def install(directory: Path) -> Callable[[], None]:
    """Routes pie's component compiles through a memo kept in `directory`; returns the undo."""
    directory.mkdir(parents=True, exist_ok=True)
    compile_once = component_cache._compile
    guard = threading.Lock()

    def memoized(engine: Engine, wasm: bytes) -> Component:
        path = directory / f"{hashlib.sha256(wasm).hexdigest()}.cwasm"
        with guard:
            if path.exists():
                try:
                    return Component.deserialize_file(engine, str(path))
                except WasmtimeError:
                    pass  # compiled for another engine configuration: compile for this one
            component = compile_once(engine, wasm)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(bytes(component.serialize()))
            os.replace(tmp, path)
            return component

    component_cache._compile = memoized  # type: ignore[assignment]

    def undo() -> None:
        component_cache._compile = compile_once  # type: ignore[assignment]

    return undo
