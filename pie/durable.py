"""Files that survive a kill: each is replaced whole (a temporary file beside it, fsync'd, then
renamed over it and the folder fsync'd), so a crash leaves the old version or the new one,
never a torn one. For the state the server keeps across restarts (installed programs, named
snapshots); call these off the event loop."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Replaces `path` with `data`, durably."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Makes the folder's entries (files created, renamed or removed in it) durable."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
