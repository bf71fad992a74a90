"""The `futures` interface: waiting on pollables."""

from __future__ import annotations

from wasmtime.component import LinkerInstance

from pie.sandbox.host.state import current, host_call
from pie.sandbox.wasm import add_host_func

INTERFACE = "pie:inferlet/futures@0.1.0"


def poll(pending: list[int]) -> list[int]:
    return current().wait_any(pending)


def ready(pending: int) -> bool:
    return current().is_ready(pending)


def discard(pending: int) -> None:
    current().discard(pending)


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "poll", host_call(poll))
    add_host_func(instance, "ready", host_call(ready))
    add_host_func(instance, "discard", discard)
