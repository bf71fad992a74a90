"""The `session` interface: messages with the client that launched the inferlet."""

from __future__ import annotations

import json
from typing import Any

from wasmtime.component import LinkerInstance

from pie.events import inferlet as ev
from pie.sandbox.host.state import HostFailure, current, host_call
from pie.sandbox.wasm import add_host_func

INTERFACE = "pie:inferlet/session@0.1.0"

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""The protocol's frame limit (pie.wire.frames.DEFAULT_MAX_FRAME), which clients enforce."""
ENVELOPE_BYTES = 4096
"""Room in the frame for what wraps the message (its instance, sequence number and type)."""
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES - ENVELOPE_BYTES
"""A message's size as the client receives it: JSON text (escapes included) or base64."""


def encoded_size(message: str | bytes) -> int:
    """The bytes `message` takes in a frame: a JSON string (a control or non-ASCII character
    is a 6- or 12-byte escape) or base64 for bytes."""
    if isinstance(message, str):
        return len(json.dumps(message))
    return 4 * ((len(message) + 2) // 3) + 2


def send(message: Any) -> None:
    state = current()
    # The raw length first, so an obviously large message costs no encoding.
    size = len(message) if len(message) > MAX_MESSAGE_BYTES else encoded_size(message)
    if size > MAX_MESSAGE_BYTES:
        raise HostFailure(
            "too-large",
            f"a message of {len(message)} bytes takes {size} or more bytes in the client's frame,"
            f" over the {MAX_MESSAGE_BYTES} it holds (escapes and base64 count)",
        )
    if isinstance(message, str):
        event = ev.SessionMessage(instance=state.instance, text=message)
    else:
        event = ev.SessionMessage(instance=state.instance, data=bytes(message))
    state.bridge.post("inferlets", event)


def receive() -> int:
    state = current()
    handle = state.session_receive()
    if state.trace is not None:
        state.trace.opened(handle, "pie.session.receive")
    return handle


def received(pending: int) -> Any:
    message: ev.SessionInput = current().take(pending, "session")
    return message.text if message.text is not None else message.data


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "send", host_call(send))
    add_host_func(instance, "receive", receive)
    add_host_func(instance, "received", host_call(received))
