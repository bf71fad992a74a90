"""Bytes a client sends: a file as a session message (refused before anything is sent when its
frame would be over the server's frame limit), and a program uploaded in chunks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pie.client.errors import MessageTooLarge, PieError
from pie.client.inferlet import ProgramInfo
from pie.wire import messages as msg
from pie.wire.frames import encode_frame

if TYPE_CHECKING:
    from pie.client.connection import Client

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


async def upload(
    client: Client,
    data: bytes,
    digest: str,
    name: str,
    version: str,
    chunk_size: int,
    progress: Callable[[int, int], None] | None,
) -> ProgramInfo:
    count = max(1, -(-len(data) // chunk_size))
    report = _ignore if progress is None else (lambda received: progress(received, len(data)))
    reply = None
    for index in range(count):
        chunk = data[index * chunk_size : (index + 1) * chunk_size]
        request = msg.UploadProgram(
            corr=client._corr(), name=name, version=version, hash=digest, size=len(data),
            index=index, count=count, data=chunk,
        )  # fmt: skip
        last = index == count - 1
        # The last chunk's answer is ProgramFound once compiled, maybe after its progress.
        reply = await client._call(request, progress=_ignore if last else None)
        if isinstance(reply, msg.UploadProgress):
            report(reply.received)
    if not isinstance(reply, msg.ProgramFound):
        raise PieError(f"the server did not confirm the upload of {name}@{version}")
    report(len(data))
    return program_info(reply)


def program_info(found: msg.ProgramFound) -> ProgramInfo:
    return ProgramInfo(hash=found.hash, name=found.name, version=found.version, size=found.size)


def _ignore(received: int) -> None:
    pass
