"""A file as a session message: its bytes in a `SendMessage` frame, refused before anything is
sent when the frame would be over the server's frame limit."""

from __future__ import annotations

from pathlib import Path

from pie.client.errors import MessageTooLarge
from pie.wire import messages as msg
from pie.wire.frames import encode_frame

FRAME_OVERHEAD = 256
"""Bytes a SendMessage frame adds around its base64 data (fields, instance id), at most."""


def checked_size(path: Path, max_frame: int) -> int:
    """The file's size; raises `MessageTooLarge` when its frame cannot fit, OSError when it
    cannot be read."""
    size = path.stat().st_size
    if 4 * -(-size // 3) + FRAME_OVERHEAD > max_frame:
        raise MessageTooLarge(path, size, max_frame)
    return size


def file_message(corr: int, instance: str, path: Path, max_frame: int) -> msg.SendMessage:
    """The request that sends `path`'s bytes to `instance` (a file that cannot fit is never
    read)."""
    size = checked_size(path, max_frame)
    request = msg.SendMessage(corr=corr, instance=instance, data=path.read_bytes())
    if len(encode_frame(request)) > max_frame:
        raise MessageTooLarge(path, size, max_frame)
    return request
