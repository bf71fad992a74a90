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
    arrived: float
    offset: int = 0


class SchedulerCore:
    """Fires a batch when the driver is idle and either the queue holds as many requests as the
    last batch did, or the oldest request has waited as long as the last pass took. The first
    request ever, and any request while nothing was fired yet, goes at once. Batches are taken
    in FIFO order and a request larger than the token budget left is split, so no request is
    overtaken; one behind a long prefill waits for the prefill's chunks ahead of it."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._queue: collections.deque[_Work] = collections.deque()
        self._next_batch = 1
        self._in_flight = False
        self._last_size = 0
        self._last_seconds = 0.0
        self._batches = 0
        self._requests = 0
        self._tokens = 0
        self._chunks = 0
        self._max_size = 0
        self._histogram: collections.Counter[int] = collections.Counter()

    def submit(self, request: ForwardRequest, now: float) -> None:
        self._queue.append(_Work(request, now))

    def pass_finished(self, seconds: float) -> None:
        self._in_flight = False
        self._last_seconds = seconds

    def deadline(self) -> float | None:
        """When the waiting rule fires the oldest request, if anything is queued."""
        if self._in_flight or not self._queue:
            return None
        return self._queue[0].arrived + self._last_seconds

    def next_batch(self, now: float) -> ExecuteBatch | None:
        if self._in_flight or not self._queue or not self._should_fire(now):
            return None
        requests = self._take()
        self._record(requests)
        self._in_flight = True
        batch = ExecuteBatch(batch=self._next_batch, requests=tuple(requests))
        self._next_batch += 1
        return batch

    def _should_fire(self, now: float) -> bool:
        if len(self._queue) >= max(self._last_size, 1):
            return True
        if sum(len(w.request.tokens) - w.offset for w in self._queue) >= self.policy.max_batch_tokens:
            return True
        return now - self._queue[0].arrived >= self._last_seconds

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
