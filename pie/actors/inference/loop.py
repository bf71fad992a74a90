"""The pass loop: the one thread that calls the driver.

Each pass takes the scheduler's batch, when one is waiting, and fills the rest of the driver's
limits with queued lane passes (pie/actors/speculator/lanes.py), one per context. When the
pass ends, lane results go straight to their programs and staged passes are queued before the
next pass starts; what the scheduler sent is reported to the Trio thread as one `PassReport`.

At speculation depth 0 nothing is staged, so after a pass the loop waits for the programs of
that pass to send their next decode before firing, up to one pass time (the scheduler's rule):
otherwise concurrent decoders would split into ever smaller batches.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from attrs import define, field

from pie.actors.speculator.lanes import Effects, LanePass, Lanes
from pie.drivers.base import Driver
from pie.drivers.batch import ForwardBatch
from pie.events.forward import ForwardRequest
from pie.events.sampling import SlotOutput


@define
class PassReport:
    """One pass, as the Trio thread needs it: the scheduler's requests and what became of
    each (their outputs, or the exception that failed them)."""

    batch: int | None
    requests: Sequence[ForwardRequest]
    results: list[list[SlotOutput] | Exception]
    seconds: float


@define
class _Item:
    request: ForwardRequest | None = None
    lane_pass: LanePass | None = None
    result: list[SlotOutput] | Exception | None = None


@define
class _Pending:
    batch: int
    requests: Sequence[ForwardRequest]
    arrived: float = field(factory=time.perf_counter)


class PassLoop:
    def __init__(
        self,
        driver: Driver,
        lanes: Lanes,
        report: Callable[[PassReport], None],
        *,
        max_requests: int,
        max_tokens: int,
    ) -> None:
        self.driver = driver
        self.lanes = lanes
        self._report = report
        self._max_requests = max_requests
        self._max_tokens = max_tokens
        self._cond = lanes.cond
        self._batches: collections.deque[_Pending] = collections.deque()
        self._stopping = False
        self._last_end = 0.0
        self.passes = 0
        self.lane_passes = 0
        self.tokens = 0
        self.busy_seconds = 0.0
        self.last_seconds = 0.0
        """Counters kept by the driver thread (read from others without a lock)."""
        self._thread: threading.Thread | None = None
        self._outbox = _Outbox()

    def start(self) -> None:
        self._outbox.start()
        self._thread = threading.Thread(target=self._main, name="pie-pass-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._outbox.stop()

    def execute(self, batch: int, requests: Sequence[ForwardRequest]) -> None:
        """The scheduler's batch, run in the next pass (Trio thread)."""
        with self._cond:
            self._batches.append(_Pending(batch, requests))
            self._cond.notify_all()

    # -- the driver thread -----------------------------------------------------------------

    def _main(self) -> None:
        while True:
            with self._cond:
                taken = self._wait_for_work()
                if taken is None:
                    return
            try:
                self._run(*taken)
            except Exception:  # the loop must outlive a bug in one pass's bookkeeping
                traceback.print_exc(file=sys.stderr)

    def _wait_for_work(self) -> tuple[_Pending | None, list[LanePass]] | None:
        while not self._stopping:
            pending = self._batches[0] if self._batches else None
            timeout: float | None = None
            if pending is None and self.lanes.has_ready():
                timeout = self._lanes_due_in()
            if pending is not None or (
                self.lanes.has_ready() and timeout is not None and timeout <= 0
            ):
                if pending is not None:
                    self._batches.popleft()
                return pending, self._take_lanes(pending)
            self._cond.wait(timeout)
        return None

    def _lanes_due_in(self) -> float:
        """Seconds until queued lane passes should go without the lanes still awaited."""
        if not self.lanes.awaited:
            return 0.0
        return self._last_end + self.last_seconds - time.perf_counter()

    def _take_lanes(self, pending: _Pending | None) -> list[LanePass]:
        requests = len(pending.requests) if pending else 0
        tokens = sum(len(r.tokens) for r in pending.requests) if pending else 0
        room = min(self._max_requests - requests, self._max_tokens - tokens)
        return self.lanes.take_ready(max(room, 0))

    def _run(self, pending: _Pending | None, lane_passes: list[LanePass]) -> None:
        started = time.perf_counter()
        items = [_Item(request=r) for r in pending.requests] if pending else []
        items.extend(_Item(lane_pass=p) for p in lane_passes)
        self._forward(items)
        ended = time.perf_counter()
        self.last_seconds = ended - started
        self._last_end = ended
        self.passes += 1
        self.lane_passes += len(lane_passes)
        self.busy_seconds += ended - started
        self.tokens += len(lane_passes) + sum(
            len(item.request.tokens) for item in items if item.request
        )
        effects: list[Effects] = []
        if lane_passes:
            outputs = [
                None if isinstance(item.result, Exception) or not item.result else item.result[0]
                for item in items[len(items) - len(lane_passes) :]
            ]
            effects.append(self.lanes.completed(lane_passes, outputs))
        report = None
        if pending is not None:
            for item in items[: len(pending.requests)]:
                request = item.request
                assert request is not None
                if request.lease is not None and request.final:
                    result = item.result
                    output = result[-1] if isinstance(result, list) and result else None
                    effects.append(self.lanes.opened(request.lease, output))
            report = PassReport(
                batch=pending.batch,
                requests=pending.requests,
                results=[item.result for item in items[: len(pending.requests)]],  # type: ignore[misc]
                seconds=ended - started,
            )
        self._settle(effects, report)

    def _settle(self, effects: list[Effects], report: PassReport | None) -> None:
        """Hands a pass's deliveries and reports on. When the next pass can start at once,
        the outbox thread does it while that pass runs; otherwise this thread does it now
        (after anything the outbox still holds, so their order is kept)."""

        def settle() -> None:
            for batch in effects:
                self.lanes.run(batch)
            if report is not None:
                self._report(report)

        with self._cond:
            ready = self.lanes.has_ready() or bool(self._batches)
        if ready or not self._outbox.idle():
            self._outbox.put(settle)
        else:
            settle()

    def _forward(self, items: list[_Item]) -> None:
        """Runs the items in one pass; when the driver refuses it, runs them one by one so
        that only the culprit fails (the driver checks a batch before writing any KV)."""
        try:
            outputs = self.driver.forward(_batch(items))
        except Exception as err:
            if len(items) == 1:
                items[0].result = err
                return
            for item in items:
                self._forward([item])
            return
        cursor = 0
        for item in items:
            count = len(item.request.slots) if item.request is not None else 1
            item.result = outputs[cursor : cursor + count]
            cursor += count


class _Outbox:
    """A thread that runs what it is handed, in order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._work: collections.deque[Callable[[], None] | None] = collections.deque()
        self._busy = False

    def start(self) -> None:
        threading.Thread(target=self._main, name="pie-pass-outbox", daemon=True).start()

    def stop(self) -> None:
        self.put(None)

    def put(self, work: Callable[[], None] | None) -> None:
        with self._cond:
            self._work.append(work)
            self._busy = True
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return not self._busy

    def _main(self) -> None:
        while True:
            with self._cond:
                while not self._work:
                    self._busy = False
                    self._cond.wait()
                work = self._work.popleft()
            if work is None:
                return
            try:
                work()
            except Exception:
                traceback.print_exc(file=sys.stderr)


def _batch(items: list[_Item]) -> ForwardBatch:
    batch = ForwardBatch()
    for item in items:
        if item.request is not None:
            batch.add(item.request)
        else:
            p = item.lane_pass
            assert p is not None
            lease = p.lane.lease
            batch.add_decode(
                p.token, p.position, p.lane.pages_for(p.slot), p.slot + 1, lease.masked_pages, p.op
            )
    return batch
