"""One model's media: items decoded and prepared from encoded bytes, held by content hash while
programs hold them, and their encoder outputs, computed batched for whatever a pass needs and
kept in a cache bounded in bytes, so that forks and repeated media are never encoded again."""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence

import torch
from attrs import frozen

from pie.config import MediaConfig
from pie.drivers.models.media import MediaRows, MediaTowers, PreparedMedia, place_span
from pie.events.forward import MediaRun
from pie.media import MediaError, MediaTooLarge, decode_audio, decode_image, decode_video

MediaSource = tuple[str, int | None, bytes]
"""(kind, max_frames, encoded bytes)."""

TOWERS = {"image": "vision", "video": "vision", "audio": "audio"}
"""The tower each kind of media needs, for refusals that name it."""


class MediaRefused(ValueError):
    """Media this model cannot take: `kind` is a stable word (unsupported-media, bad-media,
    too-large, unknown-media)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@frozen(kw_only=True, eq=False)
class MediaItem:
    key: str
    """The content hash that names it in passes (kind, options and bytes)."""
    prepared: PreparedMedia
    rope_index: torch.Tensor
    """[soft_count, 3]: each soft token's (t, h, w) index, in encoder-output order."""
    source: MediaSource
    """What `MediaStore.add` rebuilds the identical item (and key) from."""


class MediaStore:
    """Thread-safe: programs add media on their threads, the driver reads it in passes."""

    def __init__(
        self,
        model: MediaTowers,
        name: str,
        tokenize: Callable[[str], Sequence[int]],
        limits: MediaConfig,
        *,
        cache_bytes: int,
    ) -> None:
        self.model = model
        self.name = name
        self.tokenize = tokenize
        """The model's tokenizer for spans' text pieces (the engine wraps it in the lock its
        other users take)."""
        self._limits = limits
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._items: dict[str, MediaItem] = {}
        self._holders: collections.Counter[str] = collections.Counter()
        self._per_user: collections.Counter[str] = collections.Counter()
        self._encoded: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._encoded_bytes = 0
        self.encodes = 0
        """Encoder calls made (each covers every item a pass lacked)."""
        self.encoded_items = 0

    @property
    def chat_placeholders(self) -> Mapping[str, str]:
        return self.model.chat_placeholders

    def add(
        self, kind: str, data: bytes, max_frames: int | None = None, *, user: str | None = None
    ) -> MediaItem:
        """Decodes and prepares `data` as `kind` for this model, held until `release`; a hold
        for a `user` counts toward [media] max_items_per_user."""
        if kind not in self.model.modalities:
            reads = ", ".join(sorted(self.model.modalities)) or "text only"
            raise MediaRefused(
                "unsupported-media",
                f"model {self.name!r} has no {TOWERS.get(kind, kind)} tower for {kind} "
                f"(it reads {reads})",
            )
        self._count_in(user)
        try:
            return self._hold(kind, data, max_frames)
        except BaseException:
            self._count_out(user)
            raise

    def release(self, key: str, *, user: str | None = None) -> None:
        """One holder of `key` (counted for `user`, if given) lets go; the prepared item goes
        with the last (its encoder output stays cached)."""
        self._count_out(user)
        with self._lock:
            self._holders[key] -= 1
            if self._holders[key] <= 0:
                del self._holders[key]
                self._items.pop(key, None)

    def held_by(self, user: str) -> int:
        """Holds `user`'s programs have on this model's media."""
        with self._lock:
            return self._per_user[user]

    def _count_in(self, user: str | None) -> None:
        if user is None:
            return
        limit = self._limits.max_items_per_user
        with self._lock:
            if self._per_user[user] >= limit:
                raise MediaRefused(
                    "quota",
                    f"user {user!r} already holds {limit} media items on model {self.name!r}; "
                    "free one first (media.max_items_per_user)",
                )
            self._per_user[user] += 1

    def _count_out(self, user: str | None) -> None:
        if user is None:
            return
        with self._lock:
            self._per_user[user] -= 1
            if self._per_user[user] <= 0:
                del self._per_user[user]

    def _hold(self, kind: str, data: bytes, max_frames: int | None) -> MediaItem:
        key = _key(kind, data, max_frames)
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._holders[key] += 1
                return item
        item = self._prepared(kind, data, max_frames, key)
        with self._lock:
            item = self._items.setdefault(key, item)
            self._holders[key] += 1
        return item

    def item(self, key: str) -> MediaItem:
        with self._lock:
            item = self._items.get(key)
        if item is None:
            raise MediaRefused("unknown-media", f"no media {key[:16]} is held for this model")
        return item

    def source(self, key: str) -> MediaSource | None:
        """What the held item `key` was added from (None when no program holds it)."""
        with self._lock:
            item = self._items.get(key)
        return None if item is None else item.source

    def rows(
        self, runs: Sequence[tuple[int, MediaRun]], device: torch.device, dtype: torch.dtype
    ) -> MediaRows:
        """The soft-token rows of a pass: (first flat token, run) pairs, the media a run
        names encoded first where the cache lacks them, all in one encoder call."""
        embeds = self._embeddings({run.media for _, run in runs})
        rows, values, index = [], [], []
        for first, run in runs:
            end = run.offset + run.count
            rows.append(torch.arange(first, first + run.count))
            values.append(embeds[run.media][run.offset : end])
            index.append(self.item(run.media).rope_index[run.offset : end])
        return MediaRows(
            rows=torch.cat(rows).to(device),
            embeds=torch.cat(values).to(device=device, dtype=dtype),
            rope_index=torch.cat(index).to(device),
        )

    def place(self, key: str, start: int) -> tuple[list[int], list[int], tuple[MediaRun, ...]]:
        """The item's tokens laid out from position `start`: (tokens, positions, media runs
        over its soft tokens, one per stretch of consecutive ones)."""
        placed = place_span(self.item(key).prepared.span, start)
        runs: list[MediaRun] = []
        for row, index in enumerate(placed.soft):
            last = runs[-1] if runs else None
            if last is not None and last.index + last.count == index:
                runs[-1] = MediaRun(
                    index=last.index, count=last.count + 1, media=key, offset=last.offset
                )
            else:
                runs.append(MediaRun(index=index, count=1, media=key, offset=row))
        return placed.tokens, placed.positions, tuple(runs)

    def statistics(self) -> tuple[int, int, int]:
        """(items held, encoder outputs cached, their bytes)."""
        with self._lock:
            return len(self._items), len(self._encoded), self._encoded_bytes

    def _embeddings(self, keys: set[str]) -> dict[str, torch.Tensor]:
        with self._lock:
            found = {k: self._encoded[k] for k in keys if k in self._encoded}
            for k in found:
                self._encoded.move_to_end(k)
        missing = sorted(keys - found.keys())
        if missing:
            items = [self.item(k).prepared for k in missing]
            outputs = self.model.encode(items)
            self.encodes += 1
            self.encoded_items += len(items)
            for key, out in zip(missing, outputs, strict=True):
                found[key] = out
                self._cache(key, out)
        return found

    def _cache(self, key: str, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        with self._lock:
            if key in self._encoded:
                return
            self._encoded[key] = embeds
            self._encoded_bytes += size
            while self._encoded_bytes > self._cache_bytes and len(self._encoded) > 1:
                _, old = self._encoded.popitem(last=False)
                self._encoded_bytes -= old.numel() * old.element_size()

    def _prepared(self, kind: str, data: bytes, max_frames: int | None, key: str) -> MediaItem:
        decoded = self._decoded(kind, data, max_frames)
        try:
            prepared = self.model.prepare(kind, decoded, self.tokenize)
        except ValueError as exc:
            raise MediaRefused("bad-media", str(exc)) from None
        placed = place_span(prepared.span, 0)
        return MediaItem(
            key=key,
            prepared=prepared,
            rope_index=placed.rope_index,
            source=(kind, max_frames, data),
        )

    def _decoded(self, kind: str, data: bytes, max_frames: int | None) -> object:
        try:
            if kind == "image":
                return decode_image(data, self._limits)
            if kind == "video":
                return decode_video(data, max_frames, self._limits)
            return decode_audio(data, self.model.audio_rate, self._limits)
        except MediaTooLarge as exc:
            raise MediaRefused("too-large", str(exc)) from None
        except MediaError as exc:
            raise MediaRefused("bad-media", str(exc)) from None


def _key(kind: str, data: bytes, max_frames: int | None) -> str:
    digest = hashlib.blake2b(f"{kind} {max_frames}\n".encode(), digest_size=16)
    digest.update(data)
    return digest.hexdigest()
