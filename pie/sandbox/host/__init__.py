"""The host side of the inferlet API (sdk/wit/inferlet.wit): one module per interface.

Host functions find their instance through a thread-local (`state.current`), because every
instance runs on a thread of its own; so one linker serves every instance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wasmtime.component import Linker

from pie.sandbox.host import (
    context,
    forward,
    futures,
    generate,
    grammar,
    http,
    mcp,
    media,
    messaging,
    model,
    runtime,
    serving,
    session,
    speech,
)
from pie.sandbox.host.records import ModelView
from pie.sandbox.host.state import (
    Bridge,
    HostFailure,
    InstanceState,
    bind,
    current,
)
from pie.sandbox.wasm import HostWrap, wrapping

TYPES_INTERFACE = "pie:inferlet/types@0.1.0"
INTERFACES = (
    model,
    context,
    media,
    speech,
    forward,
    generate,
    grammar,
    futures,
    session,
    messaging,
    runtime,
    http,
    mcp,
    serving,
)


InterfaceWrap = Callable[[str, str, Callable[..., Any]], Callable[..., Any]]
"""Given an interface's name, a function's name and its body, the body to define instead."""


def add_inferlet_api(linker: Linker, wrap: InterfaceWrap | None = None) -> None:
    """Defines every interface of the `inferlet` world on `linker`; with `wrap`, each function
    as `wrap(interface, name, fn)` (recording, replay)."""
    root = linker.root()
    try:
        # Only types live in `types`; components still import it as an instance.
        root.add_instance(TYPES_INTERFACE).close()
        for module in INTERFACES:
            with root.add_instance(module.INTERFACE) as instance:
                with wrapping(_bound_to(wrap, module.INTERFACE)):
                    module.register(instance)
    finally:
        root.close()


def _bound_to(wrap: InterfaceWrap | None, interface: str) -> HostWrap | None:
    if wrap is None:
        return None
    return lambda name, fn: wrap(interface, name, fn)


__all__ = [
    "Bridge",
    "HostFailure",
    "InstanceState",
    "InterfaceWrap",
    "ModelView",
    "add_inferlet_api",
    "bind",
    "current",
]
