"""Named snapshots kept on disk so that they outlive the process: one JSON record per snapshot
holding what rebuilds it (its user, name, tokens, positions, the LoRA adapter each run of
tokens went through, masked and released pages), each
written atomically (a temporary file, fsync, rename, fsync of the folder) so a kill leaves the
old record or the new one, never half of one."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from attrs import frozen

from pie.actors.kv.context import Chain
from pie.durable import fsync_directory, write_atomically

log = logging.getLogger(__name__)


@frozen(kw_only=True)
class SnapshotRecord:
    """What a snapshot's KV is recomputed from: its tokens, run at their positions through the
    adapters they ran through, with the recorded pages masked (and released) afterwards."""

    user: str
    name: str
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    masked: tuple[int, ...] = ()
    released: tuple[int, ...] = ()
    adapters: tuple[tuple[int, str | None], ...] = ()
    """(first token, adapter) where the adapter changes (see Chain.adapter_runs)."""

    def segments(self) -> list[tuple[int, int, str | None]]:
        """(start, end, adapter) for each run of tokens, in order, empty runs left out."""
        starts: list[tuple[int, str | None]] = [(0, None), *self.adapters]
        ends = [*(start for start, _ in starts[1:]), len(self.tokens)]
        runs = [(start, end, name) for (start, name), end in zip(starts, ends, strict=True)]
        return [run for run in runs if run[1] > run[0]]

    @classmethod
    def of(cls, user: str, name: str, chain: Chain) -> SnapshotRecord:
        return cls(
            user=user,
            name=name,
            tokens=tuple(chain.tokens),
            positions=tuple(chain.positions),
            masked=tuple(sorted(chain.masked)),
            released=tuple(chain.released()),
            adapters=tuple(chain.adapter_runs),
        )

    def encode(self) -> bytes:
        body = {
            "user": self.user,
            "name": self.name,
            "tokens": list(self.tokens),
            "positions": list(self.positions),
            "masked": list(self.masked),
            "released": list(self.released),
        }
        if self.adapters:
            body["adapters"] = [list(run) for run in self.adapters]
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> SnapshotRecord:
        """Raises ValueError on anything but a whole, consistent record."""
        body: Any = json.loads(data)
        keys = {"user", "name", "tokens", "positions", "masked"}
        # "released" and "adapters" are left out by older records, and "adapters" by one whose
        # tokens all ran through the base model.
        if not isinstance(body, dict) or not keys <= set(body) <= keys | {"released", "adapters"}:
            raise ValueError("not a snapshot record")
        user, name = body["user"], body["name"]
        if not isinstance(user, str) or not isinstance(name, str):
            raise ValueError("the user and the name must be strings")
        record = cls(
            user=user,
            name=name,
            tokens=_ints(body["tokens"], "tokens"),
            positions=_ints(body["positions"], "positions"),
            masked=_ints(body["masked"], "masked"),
            released=_ints(body.get("released", []), "released"),
            adapters=_runs(body.get("adapters", [])),
        )
        if len(record.tokens) != len(record.positions):
            raise ValueError(f"{len(record.tokens)} tokens but {len(record.positions)} positions")
        return record


def _runs(value: Any) -> tuple[tuple[int, str | None], ...]:
    runs = value if isinstance(value, list) else None
    if runs is None or not all(
        isinstance(run, list)
        and len(run) == 2
        and type(run[0]) is int
        and (run[1] is None or isinstance(run[1], str))
        for run in runs
    ):
        raise ValueError("adapters must be a list of [first token, adapter name or null]")
    return tuple((run[0], run[1]) for run in runs)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{what} must be a list of non-negative integers")
    return tuple(value)


class SnapshotStore:
    """`<directory>/<digest of the user>/<digest of the name>.json`. Every method reads, writes
    or fsyncs files: call them off the event loop."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def write(self, record: SnapshotRecord) -> None:
        """Keeps `record` durably (replacing one of the same user and name); writing the bytes
        that are there already does nothing."""
        path = self._path(record.user, record.name)
        data = record.encode()
        try:
            if path.read_bytes() == data:
                return
        except FileNotFoundError:
            pass
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True)
            fsync_directory(self.directory)
        write_atomically(path, data)

    def remove(self, user: str, name: str) -> None:
        path = self._path(user, name)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_directory(path.parent)

    def drop(self, user: str) -> None:
        """Removes every record of `user`."""
        folder = self._user_folder(user)
        if folder.exists():
            shutil.rmtree(folder)
            fsync_directory(self.directory)

    def read_all(self) -> list[SnapshotRecord]:
        """Every record kept, in a stable order. A damaged record, or one that is not where its
        user and name put it, is logged and left out; temporary files a kill left are removed."""
        records = []
        for path in sorted(self.directory.glob("*/*")):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            try:
                record = SnapshotRecord.decode(path.read_bytes())
                if self._path(record.user, record.name) != path:
                    raise ValueError("the record names another user or snapshot")
            except (OSError, ValueError) as exc:
                log.warning("named snapshots: %s left out (%s)", path, exc)
                continue
            records.append(record)
        return records

    def _user_folder(self, user: str) -> Path:
        return self.directory / _digest(user)

    def _path(self, user: str, name: str) -> Path:
        # Any user or snapshot name works as a file name this way, however it is spelled.
        return self._user_folder(user) / f"{_digest(name)}.json"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]
