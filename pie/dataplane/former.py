"""The batch former: what the next forward pass holds and when it fires, for placed requests
and lane passes alike. Pure: time comes in as an argument and the lanes are described by a
count, so tests drive it without threads or a clock."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Protocol

import attrs
from attrs import define, frozen

from pie.events.forward import ForwardRequest, split_media


@frozen(kw_only=True)
class BatchPolicy:
    max_batch_tokens: int = 512
    max_batch_requests: int = 64
    decode_tokens: int = 16
    """A request with at most this many tokens left counts as a decode: decodes are served
    before prefill chunks, which take the token budget they leave."""

    def __attrs_post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_batch_requests < 1:
            raise ValueError("batch limits must be >= 1")
        if self.decode_tokens < 1:
            raise ValueError("decode_tokens must be >= 1")


class LaneView(Protocol):
    """The lanes as the former sees them: passes queued to run, and whether a lane of the last
    pass is expected to send its next one (`awaited` is truthy then). The lanes themselves
    (lanes.py) are one, read under their lock."""

    @property
    def ready(self) -> int: ...

    @property
    def awaited(self) -> object: ...


@frozen(kw_only=True)
class LaneState:
    """A LaneView of given values."""

    ready: int = 0
    awaited: bool = False


@frozen(kw_only=True)
class FormedPass:
    """The former's decision: run these placed requests and up to `lanes` lane passes."""

    batch: int
    requests: tuple[ForwardRequest, ...]
    lanes: int


@frozen(kw_only=True)
class BatchStatistics:
    batches: int
    """Passes fired."""
    requests: int
    """Placed requests (and chunks of them) run; lane passes are counted apart."""
    lane_passes: int
    tokens: int
    chunks: int
    pending: int
    in_flight: bool
    last_batch_size: int
    max_batch_size: int
    mean_batch_size: float
    """Requests and lane passes per pass."""
    last_pass_seconds: float
    batch_size_histogram: tuple[tuple[int, int], ...]


@define
class _Work:
    request: ForwardRequest
    offset: int = 0

    @property
    def left(self) -> int:
        return len(self.request.tokens) - self.offset


NO_LANES = LaneState()


class BatchFormer:
    """Fires a pass when the driver is idle and every context of the last pass has sent its
    next request, or the queued work fills a pass, or the watchdog runs out (one pass time
    after the last pass, stretched when contexts came back slowly). Waiting for the contexts
    of the last pass, rather than for "as many requests as last time", keeps concurrent
    decoders in one pass instead of two alternating halves.

    A pass takes lane passes first, then queued decodes in arrival order, then prefills with
    the token budget left (a prefill longer than that is split into chunks that keep their
    order), so no decode waits behind another context's prefill. A context's requests never
    overtake each other, and a pass holds at most one request of a context.
    """

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._queue: collections.deque[_Work] = collections.deque()
        self._next_batch = 1
        self._in_flight = False
        self._last_seconds = 0.0
        self._finished_at = 0.0
        self._running: set[int] = set()
        self._awaited: set[int] = set()
        self._slowest_return = 0.0
        self._return_window = 0.0
        self._batches = 0
        self._requests = 0
        self._lane_passes = 0
        self._tokens = 0
        self._chunks = 0
        self._last_size = 0
        self._max_size = 0
        self._histogram: collections.Counter[int] = collections.Counter()

    def submit(self, request: ForwardRequest, now: float) -> None:
        self._queue.append(_Work(request))
        if request.context in self._awaited:
            self._awaited.discard(request.context)
            self._slowest_return = max(self._slowest_return, now - self._finished_at)

    def drop(self, corr: int) -> None:
        """Forgets what is left of request `corr` (an earlier chunk of it failed)."""
        self._queue = collections.deque(w for w in self._queue if w.request.corr != corr)

    def pass_finished(self, seconds: float, now: float = 0.0) -> None:
        """The pass fired last took `seconds` and ended at `now`; its contexts are now awaited."""
        self._in_flight = False
        self._last_seconds = seconds
        self._finished_at = now
        if self._running:
            self._awaited = self._running - {w.request.context for w in self._queue}
            self._running = set()

    def deadline(self, lanes: LaneView = NO_LANES) -> float | None:
        """When the watchdog fires whatever is queued, if anything is queued."""
        if self._in_flight or not (self._queue or lanes.ready):
            return None
        return self._finished_at + self._patience()

    def _patience(self) -> float:
        """How long after a pass the watchdog waits for that pass's contexts: one pass time,
        stretched (up to two) when they took longer than that to come back last time, since
        several busy programs on few cores can need more than a pass to answer and firing
        without them splits the batch for good."""
        stretched = max(self._last_seconds, 1.25 * self._return_window)
        return min(stretched, 2 * self._last_seconds)

    def next_batch(self, now: float, lanes: LaneView = NO_LANES) -> FormedPass | None:
        queue = self._queue
        if self._in_flight or not (queue or lanes.ready):
            return None
        if (self._awaited or lanes.awaited) and not self._should_fire(now, lanes):
            return None
        policy = self.policy
        requests: tuple[ForwardRequest, ...] = ()
        if queue:
            # Lanes go first but leave a queued request room to run, or it could wait forever.
            lane_passes = min(
                lanes.ready, policy.max_batch_requests - 1, policy.max_batch_tokens - 1
            )
            requests = self._take(
                policy.max_batch_tokens - lane_passes, policy.max_batch_requests - lane_passes
            )
            # A context granted a lease sends its next decodes to the lanes, which await it.
            self._running = {r.context for r in requests if r.lease is None}
        else:
            lane_passes = min(lanes.ready, policy.max_batch_requests, policy.max_batch_tokens)
        if self._finished_at:
            self._return_window = self._slowest_return
        self._slowest_return = 0.0
        self._record(requests, lane_passes)
        if self._awaited:
            self._awaited = set()
        self._in_flight = True
        formed = FormedPass(batch=self._next_batch, requests=requests, lanes=lane_passes)
        self._next_batch += 1
        return formed

    def _should_fire(self, now: float, lanes: LaneView) -> bool:
        """Whether to fire while contexts of the last pass are still awaited."""
        if len(self._queue) + lanes.ready >= self.policy.max_batch_requests:
            return True
        if sum(w.left for w in self._queue) + lanes.ready >= self.policy.max_batch_tokens:
            return True
        return now >= self._finished_at + self._patience()

    def _take(self, budget: int, room: int) -> tuple[ForwardRequest, ...]:
        """Decodes first, then prefills (chunked) with the budget left; a context's requests
        keep their order."""
        taken: dict[int, ForwardRequest] = {}
        for decodes in (True, False):
            blocked: set[int] = set()
            for work in self._queue:
                context = work.request.context
                if context in taken or context in blocked:
                    blocked.add(context)
                    continue
                blocked.add(context)
                if (work.left <= self.policy.decode_tokens) != decodes:
                    continue
                if len(taken) >= room or budget <= 0:
                    break
                chunk = self._chunk(work, budget)
                taken[context] = chunk
                budget -= len(chunk.tokens)
        self._queue = collections.deque(w for w in self._queue if w.left > 0)
        return tuple(taken.values())

    def _chunk(self, work: _Work, budget: int) -> ForwardRequest:
        chunk = _split(work, budget)
        if not chunk.final:
            self._chunks += 1
        return chunk

    def _record(self, requests: Sequence[ForwardRequest], lane_passes: int) -> None:
        size = len(requests) + lane_passes
        self._last_size = size
        self._batches += 1
        self._requests += len(requests)
        self._lane_passes += lane_passes
        self._tokens += lane_passes
        if requests:
            self._tokens += sum(len(r.tokens) for r in requests)
        self._max_size = max(self._max_size, size)
        self._histogram[size] += 1

    def flush(self) -> None:
        """Hands what was recorded to whoever keeps it (a recording former; this one keeps
        nothing)."""

    def statistics(self) -> BatchStatistics:
        passes = self._requests + self._lane_passes
        return BatchStatistics(
            batches=self._batches,
            requests=self._requests,
            lane_passes=self._lane_passes,
            tokens=self._tokens,
            chunks=self._chunks,
            pending=len(self._queue),
            in_flight=self._in_flight,
            last_batch_size=self._last_size,
            max_batch_size=self._max_size,
            mean_batch_size=passes / self._batches if self._batches else 0.0,
            last_pass_seconds=self._last_seconds,
            batch_size_histogram=tuple(sorted(self._histogram.items())),
        )


def _split(work: _Work, budget: int) -> ForwardRequest:
    """The next piece of `work` that fits in `budget` tokens (the request itself when whole)."""
    req = work.request
    start = work.offset
    end = min(len(req.tokens), start + budget)
    work.offset = end
    if start == 0 and end == len(req.tokens):
        return req
    picked = [(i, s) for i, s in enumerate(req.slots) if start <= s.index < end]
    return attrs.evolve(
        req,
        tokens=req.tokens[start:end],
        positions=req.positions[start:end],
        kv_start=req.kv_start + start,
        attention_masks=None if req.attention_masks is None else req.attention_masks[start:end],
        slots=tuple(attrs.evolve(s, index=s.index - start) for _, s in picked),
        slot_positions=tuple(i for i, _ in picked),
        copies=req.copies if start == 0 else (),
        final=end == len(req.tokens),
        media=split_media(req.media, start, end),
    )
