"""Named snapshots kept on disk so that they outlive the process: one JSON record per snapshot
holding what rebuilds it (its user, name, tokens, positions, the LoRA adapter each run of
tokens went through, the custom attention masks tokens ran under, the media its soft tokens
came from, masked and released pages), each written atomically (a temporary file, fsync,
rename, fsync of the folder) so a kill leaves the old record or the new one, never half of
one. The media's encoded bytes are kept beside the records (media_blobs)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path
from typing import Any

from attrs import frozen

from pie.actors.kv.context import Chain
from pie.actors.kv.media_blobs import KEY, MediaBlobs, MediaSource
from pie.durable import fsync_directory, write_atomically
from pie.events.forward import MediaRun
from pie.events.sampling import Rle

log = logging.getLogger(__name__)

Masks = tuple[Rle, ...]
Segment = tuple[int, int, str | None, Masks | None]
"""(start, end, adapter, masks): one pass of a rebuild; masks None means causal."""


@frozen(kw_only=True)
class SnapshotRecord:
    """What a snapshot's KV is recomputed from: its tokens, run at their positions through the
    adapters and under the attention masks they ran through, with the recorded pages masked
    (and released) afterwards."""

    user: str
    name: str
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    masked: tuple[int, ...] = ()
    released: tuple[int, ...] = ()
    adapters: tuple[tuple[int, str | None], ...] = ()
    """(first token, adapter) where the adapter changes (see Chain.adapter_runs)."""
    masks: tuple[tuple[int, Masks], ...] = ()
    """(first token, one mask per token) for the tokens that ran under custom attention masks,
    each mask over the kv slots up to its token (see Chain.mask_runs)."""
    media: tuple[MediaRun, ...] = ()
    """The soft tokens and the media they came from (see Chain.media_runs)."""

    def segments(self) -> list[Segment]:
        """The passes that rebuild the KV, in order: one per run of tokens through one adapter,
        cut where custom masks begin and end; a masked one carries its tokens' masks."""
        cuts = {0, len(self.tokens)} | {start for start, _ in self.adapters}
        cuts |= {edge for start, masks in self.masks for edge in (start, start + len(masks))}
        edges = sorted(cut for cut in cuts if 0 <= cut <= len(self.tokens))
        return [self._segment(start, end) for start, end in pairwise(edges)]

    def _segment(self, start: int, end: int) -> Segment:
        adapter = None
        for first, name in self.adapters:
            if first <= start:
                adapter = name
        for first, masks in self.masks:
            if first <= start < first + len(masks):
                return (start, end, adapter, masks[start - first : end - first])
        return (start, end, adapter, None)

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
            masks=tuple(chain.mask_runs),
            media=tuple(chain.media_runs),
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
        if self.masks:
            body["masks"] = [[start, [list(mask) for mask in masks]] for start, masks in self.masks]
        if self.media:
            body["media"] = [[r.index, r.count, r.media, r.offset] for r in self.media]
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> SnapshotRecord:
        """Raises ValueError on anything but a whole, consistent record."""
        body: Any = json.loads(data)
        keys = {"user", "name", "tokens", "positions", "masked"}
        # "released", "adapters" and "masks" are left out by older records, "adapters" by one
        # whose tokens all ran through the base model, "masks" by one whose tokens all ran
        # causally and "media" by one without media.
        optional = {"released", "adapters", "masks", "media"}
        if not isinstance(body, dict) or not keys <= set(body) <= keys | optional:
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
            masks=_mask_runs(body.get("masks", [])),
            media=_media_runs(body.get("media", [])),
        )
        if len(record.tokens) != len(record.positions):
            raise ValueError(f"{len(record.tokens)} tokens but {len(record.positions)} positions")
        _check_mask_runs(record.masks, len(record.tokens))
        _check_media_runs(record.media, len(record.tokens))
        return record


def _media_runs(value: Any) -> tuple[MediaRun, ...]:
    runs = value if isinstance(value, list) else None
    if runs is None or not all(
        isinstance(run, list)
        and len(run) == 4
        and isinstance(run[2], str)
        and KEY.fullmatch(run[2])
        and all(type(run[i]) is int and run[i] >= 0 for i in (0, 1, 3))
        for run in runs
    ):
        raise ValueError("media must be a list of [first token, count, media key, offset]")
    return tuple(MediaRun(index=r[0], count=r[1], media=r[2], offset=r[3]) for r in runs)


def _check_media_runs(runs: tuple[MediaRun, ...], count: int) -> None:
    end = 0
    for run in runs:
        if run.count < 1 or run.index < end or run.index + run.count > count:
            raise ValueError(f"the media run from token {run.index} overlaps or passes the tokens")
        end = run.index + run.count


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


def _mask_runs(value: Any) -> tuple[tuple[int, Masks], ...]:
    runs = value if isinstance(value, list) else None
    if runs is None or not all(
        isinstance(run, list)
        and len(run) == 2
        and type(run[0]) is int
        and isinstance(run[1], list)
        and run[1]
        for run in runs
    ):
        raise ValueError("masks must be a list of [first token, [mask, ...]]")
    return tuple(
        (
            run[0],
            tuple(_ints(mask, f"the mask of token {run[0] + i}") for i, mask in enumerate(run[1])),
        )
        for run in runs
    )


def _check_mask_runs(runs: tuple[tuple[int, Masks], ...], count: int) -> None:
    """Runs in order, apart, within the tokens, each mask over the slots up to its token."""
    end = 0
    for start, masks in runs:
        if start < end or start + len(masks) > count:
            raise ValueError(f"the masks from token {start} overlap or pass the {count} tokens")
        end = start + len(masks)
        for token, mask in enumerate(masks, start):
            if sum(mask) != token + 1:
                raise ValueError(
                    f"the mask of token {token} covers {sum(mask)} slots, not {token + 1}"
                )


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{what} must be a list of non-negative integers")
    return tuple(value)


class SnapshotStore:
    """`<directory>/<digest of the user>/<digest of the name>.json`, and the media records
    name in `<directory>/media`. Every method reads, writes or fsyncs files: call them off the
    event loop."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.media = MediaBlobs(self.directory)

    def keep_media(self, sources: Mapping[str, MediaSource]) -> None:
        """Keeps the media a record about to be written names, by key (before the record, so
        that a record on disk always finds its media)."""
        for key, source in sources.items():
            self.media.write(key, source)

    def write(self, record: SnapshotRecord) -> None:
        """Keeps `record` durably (replacing one of the same user and name); writing the bytes
        that are there already does nothing."""
        path = self._path(record.user, record.name)
        data = record.encode()
        old = _read(path)
        if old == data:
            return
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True)
            fsync_directory(self.directory)
        write_atomically(path, data)
        if old is not None and _names_media(old):
            self._collect()

    def remove(self, user: str, name: str) -> None:
        path = self._path(user, name)
        old = _read(path)
        if old is None:
            return
        path.unlink(missing_ok=True)
        fsync_directory(path.parent)
        if _names_media(old):
            self._collect()

    def drop(self, user: str) -> None:
        """Removes every record of `user`."""
        folder = self._user_folder(user)
        if folder.exists():
            shutil.rmtree(folder)
            fsync_directory(self.directory)
            self._collect()

    def read_all(self) -> list[SnapshotRecord]:
        """Every record kept, in a stable order. A damaged record, or one that is not where its
        user and name put it, is logged and left out; temporary files a kill left are removed,
        and so are media no record names."""
        records = self._records()
        self.media.keep_only(run.media for record in records for run in record.media)
        return records

    def _records(self) -> list[SnapshotRecord]:
        records = []
        for path in sorted(self.directory.glob("*/*")):
            if path.parent == self.media.directory:
                continue
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

    def _collect(self) -> None:
        """Removes the media no record names any more."""
        self.media.keep_only(run.media for record in self._records() for run in record.media)

    def _user_folder(self, user: str) -> Path:
        return self.directory / _digest(user)

    def _path(self, user: str, name: str) -> Path:
        # Any user or snapshot name works as a file name this way, however it is spelled.
        return self._user_folder(user) / f"{_digest(name)}.json"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _names_media(data: bytes) -> bool:
    """Whether a record names media (a damaged one might: its media are collected then)."""
    try:
        return bool(SnapshotRecord.decode(data).media)
    except ValueError:
        return True


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]
