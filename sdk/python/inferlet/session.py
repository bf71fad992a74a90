"""Messages with the client that launched this inferlet."""

from __future__ import annotations

from wit_world.imports import session as _session
from wit_world.imports import types

from inferlet import _loop
from inferlet.errors import call


def send(message: str | bytes) -> None:
    """Sends text or bytes to the client (e.g. streamed tokens or progress)."""
    if isinstance(message, str):
        payload: types.Payload = types.Payload_Text(message)
    elif isinstance(message, bytes | bytearray):
        payload = types.Payload_Bytes(bytes(message))
    else:
        raise TypeError(f"session.send takes str or bytes, not {type(message).__name__}")
    call(_session.send, payload)


async def receive() -> str | bytes:
    """The next message from the client."""
    handle = _session.receive()
    await _loop.ready(handle)
    return call(_session.received, handle).value
