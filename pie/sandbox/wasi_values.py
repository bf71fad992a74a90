"""Host-side stand-ins for the WASI wall clock and random source, defined over wasmtime's own
on linkers whose calls are recorded or replayed, so that the times and random bytes a guest
reads (`time.time()`, `datetime.now()`, `os.urandom`) are recorded values too. The monotonic
clock is left to wasmtime: its `subscribe` functions return WASI pollables no host function
can make."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from wasmtime import Engine
from wasmtime.component import Component, Linker

from pie.sandbox.host import InterfaceWrap
from pie.sandbox.wasm import add_host_func, record

MAX_RANDOM_BYTES = 1 << 20
"""The most random bytes one call may ask for (the Python interpreter asks for 256 at a time)."""


def _now() -> Any:
    nanos = time.time_ns()
    return record(seconds=nanos // 1_000_000_000, nanoseconds=nanos % 1_000_000_000)


def _resolution() -> Any:
    return record(seconds=0, nanoseconds=max(1, int(time.get_clock_info("time").resolution * 1e9)))


def _random_bytes(count: int) -> bytes:
    if count > MAX_RANDOM_BYTES:
        raise ValueError(f"asked for {count} random bytes at once; the most is {MAX_RANDOM_BYTES}")
    return os.urandom(count)


def _random_u64() -> int:
    return int.from_bytes(os.urandom(8), "little")


STAND_INS: dict[str, dict[str, Callable[..., Any]]] = {
    "wasi:clocks/wall-clock": {"now": _now, "resolution": _resolution},
    "wasi:random/random": {"get-random-bytes": _random_bytes, "get-random-u64": _random_u64},
}
"""Each interface replaced (by its name without version), and its functions."""


def replaced_imports(component: Component, engine: Engine) -> tuple[str, ...]:
    """The versioned names of the component's imports that have stand-ins, sorted."""
    names = component.type.imports(engine)
    return tuple(sorted(name for name in names if name.partition("@")[0] in STAND_INS))


def add_stand_ins(linker: Linker, imports: tuple[str, ...], wrap: InterfaceWrap) -> None:
    """Defines each of `imports` (versioned names) on `linker` in place of wasmtime's, every
    function as `wrap(interface, name, fn)`."""
    linker.allow_shadowing = True
    root = linker.root()
    try:
        for interface in imports:
            functions = STAND_INS[interface.partition("@")[0]]
            with root.add_instance(interface) as instance:
                for name, fn in functions.items():
                    add_host_func(instance, name, wrap(interface, name, fn))
    finally:
        root.close()
