"""The `session` interface: messages with the client that launched the inferlet."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance

from pie.events import inferlet as ev
from pie.sandbox.host.state import HostFailure, current, host_call
from pie.sandbox.wasm import add_host_func

INTERFACE = "pie:inferlet/session@0.1.0"

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def send(message: Any) -> None:
    state = current()
    if len(message) > MAX_MESSAGE_BYTES:
        raise HostFailure("invalid", f"message of {len(message)} bytes is over the limit")
    if isinstance(message, str):
        event = ev.SessionMessage(instance=state.instance, text=message)
    else:
        event = ev.SessionMessage(instance=state.instance, data=bytes(message))
    state.bridge.post("inferlets", event)


def receive() -> int:
    return current().session_receive()


def received(pending: int) -> Any:
    message: ev.SessionInput = current().take(pending, "session")
    return message.text if message.text is not None else message.data


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "send", host_call(send))
    add_host_func(instance, "receive", receive)
    add_host_func(instance, "received", host_call(received))
