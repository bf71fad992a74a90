"""Program uploads arriving in chunks on one connection: order, size and hash are checked here,
and the bytes they hold are counted against the connection's and the user's limits until the
server has installed them (compiling is the server's job). Pure (no I/O)."""

from __future__ import annotations

import collections
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
    user: str
    received: bytearray = field(factory=bytearray)
    next_index: int = 0


class PendingBytes:
    """Announced upload bytes each user holds, all connections together, until each upload
    fails, is installed or its connection closes."""

    def __init__(self, per_user: int) -> None:
        self.per_user = per_user
        self._held = collections.Counter[str]()

    def take(self, user: str, size: int) -> None:
        if self._held[user] + size > self.per_user:
            raise Refused(
                "too-many-uploads",
                f"{user}'s unfinished uploads would hold {self._held[user] + size} bytes, over "
                f"{self.per_user}: finish or drop an upload first",
            )
        self._held[user] += size

    def give_back(self, user: str, size: int) -> None:
        self._held[user] -= size
        if self._held[user] <= 0:
            del self._held[user]

    def held(self, user: str) -> int:
        return self._held[user]


class Uploads:
    """The uploads in progress on one connection, by announced hash."""

    def __init__(self, max_size: int, *, max_pending: int, users: PendingBytes) -> None:
        self.max_size = max_size
        self.max_pending = max_pending
        self.users = users
        self._held: dict[str, _Partial] = {}
        """Uploads still arriving, and finished ones until `installed`."""

    def add(self, chunk: UploadProgram, user: str) -> int | Upload:
        """Bytes received so far, or the finished upload after its last chunk; call
        `installed` when done with it.

        Raises Refused (bad-upload, too-large, too-many-uploads, hash-mismatch); a failed
        upload is forgotten.
        """
        try:
            return self._add(chunk, user)
        except Refused:
            self._drop(chunk.hash)
            raise

    def installed(self, upload: Upload) -> None:
        """The server is done with `upload`: its bytes stop counting."""
        self._drop(upload.hash)

    def close(self) -> None:
        """The connection is gone: nothing it held counts any more."""
        for digest in list(self._held):
            self._drop(digest)

    @property
    def pending(self) -> int:
        return sum(partial.first.size for partial in self._held.values())

    def _add(self, chunk: UploadProgram, user: str) -> int | Upload:
        if chunk.index == 0:
            self._drop(chunk.hash)
            _check_announcement(chunk, self.max_size)
            self._reserve(chunk, user)
        partial = self._held.get(chunk.hash)
        if partial is None:
            raise Refused("bad-upload", f"chunk {chunk.index} of an upload that never started")
        _check_continues(partial, chunk)
        partial.received += chunk.data
        partial.next_index += 1
        if len(partial.received) > chunk.size:
            raise Refused("bad-upload", f"more than the announced {chunk.size} bytes")
        if partial.next_index < chunk.count:
            return len(partial.received)
        return _finish(partial)

    def _reserve(self, chunk: UploadProgram, user: str) -> None:
        if self.pending + chunk.size > self.max_pending:
            raise Refused(
                "too-many-uploads",
                f"this connection's unfinished uploads would hold {self.pending + chunk.size} "
                f"bytes, over {self.max_pending}: finish or drop an upload first",
            )
        self.users.take(user, chunk.size)
        self._held[chunk.hash] = _Partial(first=chunk, user=user)

    def _drop(self, digest: str) -> None:
        partial = self._held.pop(digest, None)
        if partial is not None:
            self.users.give_back(partial.user, partial.first.size)

    def __len__(self) -> int:
        return len(self._held)


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
