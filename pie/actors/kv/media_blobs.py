"""The encoded media that durable snapshots hold, kept beside their records by content hash
(`<directory>/media/<key>`): each written once, atomically, read back to rebuild the identical
item at start, and removed once no record names it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from pie.durable import fsync_directory, write_atomically

MediaSource = tuple[str, int | None, bytes]
"""(kind, max_frames, encoded bytes): what a model's media store adds an item from."""

KEY = re.compile(r"[0-9a-f]{32}")
"""A media key: the store's content hash, so it is safe as a file name."""


class MediaHolder(Protocol):
    """A model's media store, as durable snapshots use it (the engine injects the driver's)."""

    def source(self, key: str) -> MediaSource | None:
        """What the held item `key` was added from (None when none is held)."""

    def add(self, kind: str, data: bytes, max_frames: int | None = None) -> Any:
        """Holds the item `data` prepares into (an object with its `key`)."""

    def release(self, key: str) -> None: ...


class MediaBlobs:
    """Every method reads, writes or fsyncs files: call them off the event loop."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory) / "media"

    def write(self, key: str, source: MediaSource) -> None:
        """Keeps `source` under `key` (content-addressed: one already there is the same)."""
        path = self._path(key)
        if path.is_file():
            return
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True)
            fsync_directory(self.directory.parent)
        kind, max_frames, data = source
        header = json.dumps({"kind": kind, "max_frames": max_frames}).encode()
        write_atomically(path, header + b"\n" + data)

    def read(self, key: str) -> MediaSource:
        """Raises OSError for a missing blob and ValueError for a damaged one."""
        header, _, data = self._path(key).read_bytes().partition(b"\n")
        body = json.loads(header)
        kind, max_frames = body.get("kind"), body.get("max_frames")
        if not isinstance(kind, str) or not (max_frames is None or type(max_frames) is int):
            raise ValueError(f"media {key} has a damaged header")
        return kind, max_frames, data

    def keep_only(self, keys: Iterable[str]) -> None:
        """Removes every blob (and temporary file a kill left) not among `keys`."""
        if not self.directory.is_dir():
            return
        wanted = set(keys)
        gone = [path for path in self.directory.iterdir() if path.name not in wanted]
        for path in gone:
            path.unlink(missing_ok=True)
        if gone:
            fsync_directory(self.directory)

    def _path(self, key: str) -> Path:
        if not KEY.fullmatch(key):
            raise ValueError(f"{key!r} is not a media key")
        return self.directory / key
