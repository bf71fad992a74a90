"""Program uploads arriving in chunks on one connection: order, size and hash are checked here;
compiling the finished bytes is the server's job. Pure (no I/O)."""

from __future__ import annotations

import hashlib
import re

from attrs import define, field, frozen

from pie.server.hub import Refused
from pie.wire.messages import UploadProgram

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@frozen(kw_only=True)
class Upload:
    """A complete upload; `check_hash` (slow for big programs: run it off the event loop) says
    whether its bytes hash to the announced `hash`."""

    name: str
    version: str
    hash: str
    wasm: bytes


@define
class _Partial:
    first: UploadProgram
    received: bytearray = field(factory=bytearray)
    next_index: int = 0


class Uploads:
    """The uploads in progress on one connection, by announced hash."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._partial: dict[str, _Partial] = {}

    def add(self, chunk: UploadProgram) -> int | Upload:
        """Bytes received so far, or the finished upload after its last chunk.

        Raises Refused (bad-upload, too-large, hash-mismatch); a failed upload is forgotten.
        """
        try:
            return self._add(chunk)
        except Refused:
            self._partial.pop(chunk.hash, None)
            raise

    def _add(self, chunk: UploadProgram) -> int | Upload:
        if chunk.index == 0:
            _check_announcement(chunk, self.max_size)
            self._partial[chunk.hash] = _Partial(first=chunk)
        partial = self._partial.get(chunk.hash)
        if partial is None:
            raise Refused("bad-upload", f"chunk {chunk.index} of an upload that never started")
        _check_continues(partial, chunk)
        partial.received += chunk.data
        partial.next_index += 1
        if len(partial.received) > chunk.size:
            raise Refused("bad-upload", f"more than the announced {chunk.size} bytes")
        if partial.next_index < chunk.count:
            return len(partial.received)
        del self._partial[chunk.hash]
        return _finish(partial)

    def __len__(self) -> int:
        return len(self._partial)


def _check_announcement(chunk: UploadProgram, max_size: int) -> None:
    if not _SHA256.match(chunk.hash):
        raise Refused("bad-upload", "hash must be the sha256 of the program, 64 hex digits")
    if chunk.size > max_size:
        raise Refused("too-large", f"a program of {chunk.size} bytes is over {max_size}")
    if chunk.count < 1 or chunk.size < 0:
        raise Refused("bad-upload", "count must be at least 1 and size not negative")


def _check_continues(partial: _Partial, chunk: UploadProgram) -> None:
    first = partial.first
    if chunk.index != partial.next_index:
        raise Refused("bad-upload", f"chunk {chunk.index} came when {partial.next_index} was due")
    if (chunk.size, chunk.count, chunk.name, chunk.version) != (
        first.size,
        first.count,
        first.name,
        first.version,
    ):
        raise Refused("bad-upload", "size, count, name and version must not change mid-upload")


def _finish(partial: _Partial) -> Upload:
    first, data = partial.first, bytes(partial.received)
    if len(data) != first.size:
        raise Refused("bad-upload", f"received {len(data)} bytes of the announced {first.size}")
    return Upload(name=first.name, version=first.version, hash=first.hash, wasm=data)


def check_hash(upload: Upload) -> None:
    if hashlib.sha256(upload.wasm).hexdigest() != upload.hash:
        raise Refused("hash-mismatch", "the bytes do not hash to the announced sha256")
