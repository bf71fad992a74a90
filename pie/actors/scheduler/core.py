"""The scheduler's pure core: a FIFO of placed requests, chunked prefill, and the adaptive
firing rule. Time comes in as an argument, so tests drive it without a clock."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import attrs
from attrs import define, frozen

from pie.events.batching import ExecuteBatch
from pie.events.forward import ForwardRequest


@frozen(kw_only=True)
class BatchPolicy:
    max_batch_tokens: int = 512
    max_batch_requests: int = 64

    def __attrs_post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_batch_requests < 1:
            raise ValueError("batch limits must be >= 1")


@frozen(kw_only=True)
class SchedulerStatistics:
    batches: int
    requests: int
    tokens: int
    chunks: int
    pending: int
    in_flight: bool
    last_batch_size: int
    max_batch_size: int
    mean_batch_size: float
    last_pass_seconds: float
    batch_size_histogram: tuple[tuple[int, int], ...]


@define
class _Work:
    request: ForwardRequest
    offset: int = 0


class SchedulerCore:
    """Fires a batch when the driver is idle and every context that took part in the last pass
    has sent its next request, or the batch is full, or one pass time has gone by since the last
    pass finished (the watchdog for a context that went quiet). Waiting for the contexts of the
    last pass, rather than for "as many requests as last time", keeps concurrent decoders in one
    batch instead of splitting them into two alternating half-batches.

    Batches are taken in FIFO order and a request larger than the token budget left is split,
    so no request is overtaken; one behind a long prefill waits for the prefill's chunks.
    """

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._queue: collections.deque[_Work] = collections.deque()
        self._next_batch = 1
        self._in_flight = False
        self._last_size = 0
        self._last_seconds = 0.0
        self._finished_at = 0.0
        self._running: set[int] = set()
        self._awaited: set[int] = set()
        self._slowest_return = 0.0
        self._return_window = 0.0
        self._batches = 0
        self._requests = 0
        self._tokens = 0
        self._chunks = 0
        self._max_size = 0
        self._histogram: collections.Counter[int] = collections.Counter()

    def submit(self, request: ForwardRequest, now: float) -> None:
        self._queue.append(_Work(request))
        if request.context in self._awaited:
            self._awaited.discard(request.context)
            self._slowest_return = max(self._slowest_return, now - self._finished_at)

    def pass_finished(self, seconds: float, now: float = 0.0) -> None:
        """The pass fired last took `seconds` and ended at `now`; its contexts are now awaited."""
        self._in_flight = False
        self._last_seconds = seconds
        self._finished_at = now
        self._awaited = self._running - {w.request.context for w in self._queue}
        self._running = set()

    def deadline(self) -> float | None:
        """When the watchdog fires whatever is queued, if anything is queued."""
        if self._in_flight or not self._queue:
            return None
        return self._finished_at + self._patience()

    def _patience(self) -> float:
        """How long after a pass the watchdog waits for that pass's contexts: one pass time,
        stretched (up to two) when they took longer than that to come back last time, since
        several busy programs on few cores can need more than a pass to answer and firing
        without them splits the batch for good."""
        stretched = max(self._last_seconds, 1.25 * self._return_window)
        return min(stretched, 2 * self._last_seconds)

    def next_batch(self, now: float) -> ExecuteBatch | None:
        if self._in_flight or not self._queue or not self._should_fire(now):
            return None
        requests = self._take()
        if self._finished_at:
            self._return_window = self._slowest_return
        self._slowest_return = 0.0
        self._record(requests)
        # A context granted a lease sends its next decodes to the pass loop, not here.
        self._running = {r.context for r in requests if r.lease is None}
        self._awaited = set()
        self._in_flight = True
        batch = ExecuteBatch(batch=self._next_batch, requests=tuple(requests))
        self._next_batch += 1
        return batch

    def _should_fire(self, now: float) -> bool:
        if not self._awaited or len(self._queue) >= self.policy.max_batch_requests:
            return True
        if (
            sum(len(w.request.tokens) - w.offset for w in self._queue)
            >= self.policy.max_batch_tokens
        ):
            return True
        return now >= self._finished_at + self._patience()

    def _take(self) -> list[ForwardRequest]:
        budget = self.policy.max_batch_tokens
        taken: list[ForwardRequest] = []
        contexts: set[int] = set()
        kept: collections.deque[_Work] = collections.deque()
        while self._queue:
            work = self._queue.popleft()
            fits = budget > 0 and len(taken) < self.policy.max_batch_requests
            if not fits or work.request.context in contexts:
                kept.append(work)
                continue
            chunk, done = _split(work, budget)
            taken.append(chunk)
            contexts.add(work.request.context)
            budget -= len(chunk.tokens)
            if not done:
                self._chunks += 1
                kept.append(work)
        self._queue = kept
        return taken

    def _record(self, requests: Sequence[ForwardRequest]) -> None:
        size = len(requests)
        self._last_size = size
        self._batches += 1
        self._requests += size
        self._tokens += sum(len(r.tokens) for r in requests)
        self._max_size = max(self._max_size, size)
        self._histogram[size] += 1

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            batches=self._batches,
            requests=self._requests,
            tokens=self._tokens,
            chunks=self._chunks,
            pending=len(self._queue),
            in_flight=self._in_flight,
            last_batch_size=self._last_size,
            max_batch_size=self._max_size,
            mean_batch_size=self._requests / self._batches if self._batches else 0.0,
            last_pass_seconds=self._last_seconds,
            batch_size_histogram=tuple(sorted(self._histogram.items())),
        )


def _split(work: _Work, budget: int) -> tuple[ForwardRequest, bool]:
    """The next piece of `work` that fits in `budget` tokens, and whether it is the last."""
    req = work.request
    start = work.offset
    end = min(len(req.tokens), start + budget)
    work.offset = end
    if start == 0 and end == len(req.tokens):
        return req, True
    picked = [(i, s) for i, s in enumerate(req.slots) if start <= s.index < end]
    chunk = attrs.evolve(
        req,
        tokens=req.tokens[start:end],
        positions=req.positions[start:end],
        kv_start=req.kv_start + start,
        attention_masks=None if req.attention_masks is None else req.attention_masks[start:end],
        slots=tuple(attrs.evolve(s, index=s.index - start) for _, s in picked),
        slot_positions=tuple(i for i, _ in picked),
        copies=req.copies if start == 0 else (),
        final=end == len(req.tokens),
    )
    return chunk, chunk.final
