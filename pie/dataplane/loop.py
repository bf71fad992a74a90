"""The pass loop: the one thread that calls the driver.

The batch former (former.py) decides what each pass holds and when it fires: placed requests
from the kv actor and queued lane passes (lanes.py) alike. When a pass ends, staged passes are
queued and the next pass starts at once when the former says so; lane results reach their
programs, and what the kv actor placed reaches the Trio thread as one `PassReport`, from the
outbox thread while that next pass runs. A speaking model's speech requests (speech.py) take one
step after each pass, or while no pass is due.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

import attrs
from attrs import define, frozen

from pie.dataplane.former import BatchFormer, BatchStatistics, FormedPass
from pie.dataplane.lanes import Effects, LanePass, Lanes
from pie.dataplane.speech import SpeechDesk
from pie.drivers.base import Driver
from pie.drivers.batch import ForwardBatch
from pie.events.forward import ForwardRequest
from pie.events.sampling import SlotOutput


@define
class PassReport:
    """One pass, as the Trio thread needs it: the placed requests it ran and what became of
    each (their outputs, or the exception that failed them)."""

    batch: int
    requests: Sequence[ForwardRequest]
    results: list[list[SlotOutput] | Exception]
    seconds: float


Work = tuple[FormedPass, list[LanePass]]

PassObserver = Callable[["PassSummary"], None]


@frozen(kw_only=True)
class PassSummary:
    """One pass as its observers see it (metrics, traces, the dashboard), told after it ran."""

    number: int
    ended: float
    """Wall-clock time (`time.time()`) at the end of the driver's forward."""
    seconds: float
    requests: int
    """Placed requests (or chunks of them) it ran."""
    lane_passes: int
    tokens: int
    corrs: tuple[int, ...]
    """The correlation ids of its placed requests (the event log's `corr`)."""
    failed: int
    """Placed requests and lane passes it failed."""
    requesters: tuple[str, ...] = ()
    """The addresses whose placed requests and lane passes it ran, each once (a trace links
    the pass to their launches)."""


@frozen(kw_only=True)
class PassTimes:
    """Seconds the pass loop has spent in each part of its passes, summed over all of them."""

    form: float = 0.0
    """Deciding the next pass: the batch former and taking queued lane passes."""
    assemble: float = 0.0
    """Building the driver's batch."""
    forward: float = 0.0
    """The driver's forward pass."""
    complete: float = 0.0
    """What decides the pass after: staging, leases, the former's clock (driver thread)."""
    settle: float = 0.0
    """Deliveries, events, reports and counters (mostly on the outbox thread, while the next
    pass runs)."""


class PassLoop:
    def __init__(
        self,
        driver: Driver,
        lanes: Lanes,
        former: BatchFormer,
        report: Callable[[PassReport], None],
        speech: SpeechDesk | None = None,
    ) -> None:
        self.driver = driver
        self.speech = speech
        self.lanes = lanes
        self.former = former
        self._report = report
        self._cond = lanes.cond
        self._lock = lanes.lock
        self._stopping = False
        self.passes = 0
        self.lane_passes = 0
        self.tokens = 0
        self.busy_seconds = 0.0
        self.last_seconds = 0.0
        """Counters kept by the driver thread (read from others without a lock)."""
        self._times = {name: 0.0 for name in attrs.fields_dict(PassTimes) if name != "settle"}
        self._settle_seconds = 0.0
        """Apart from `_times`, which the driver thread writes: the outbox thread writes this."""
        self._thread: threading.Thread | None = None
        self._outbox = _Outbox()
        self._observers: tuple[PassObserver, ...] = ()

    def observe(self, observer: PassObserver) -> None:
        """Calls `observer(summary)` after every pass, on the thread that settles it. It must be
        quick and must not block; an observer that raises is reported and dropped."""
        self._observers = (*self._observers, observer)

    def start(self) -> None:
        self._outbox.start()
        self._thread = threading.Thread(target=self._main, name="pie-pass-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self.former.flush()
            self._cond.notify_all()
        self._outbox.stop()

    def flush_former(self) -> None:
        """Hands what the former recorded since the last pass to its sink now (any thread)."""
        with self._cond:
            self.former.flush()

    def submit(self, request: ForwardRequest) -> None:
        """A request the kv actor placed, for the former to put in a pass (any thread)."""
        with self._cond:
            self.former.submit(request, time.perf_counter())
            self._cond.notify_all()

    def batch_statistics(self) -> BatchStatistics:
        with self._cond:
            return self.former.statistics()

    def pass_times(self) -> PassTimes:
        return PassTimes(**self._times, settle=self._settle_seconds)

    # -- the driver thread -----------------------------------------------------------------

    def _main(self) -> None:
        taken: Work | None = None
        while True:
            if taken is None:
                with self._cond:
                    taken = self._wait_for_work()
                if taken is None and self._stopping:
                    return
            try:
                if taken is not None:
                    taken = self._run(*taken)
            except Exception:  # the loop must outlive a bug in one pass's bookkeeping
                traceback.print_exc(file=sys.stderr)
                taken = None
            if self.speech is not None:
                self.speech.step()

    def _wait_for_work(self) -> Work | None:
        """The next pass's work; None when stopping or when speech waits for a step."""
        while not self._stopping:
            taken, timeout = self._next_work()
            if taken is not None:
                return taken
            if self.speech is not None and self.speech.busy:
                return None
            self._cond.wait(timeout)
        return None

    def _next_work(self) -> tuple[Work | None, float | None]:
        """The next pass's work when the former fires it now, else None and how long to wait
        (None: until notified). The caller holds `cond`."""
        now = time.perf_counter()
        lanes = self.lanes
        formed = self.former.next_batch(now, lanes)
        if formed is None:
            deadline = self.former.deadline(lanes)
            return None, None if deadline is None else max(deadline - now, 0.0)
        taken = self.lanes.take_ready(formed.lanes)
        self._times["form"] += time.perf_counter() - now
        return (formed, taken), None

    def _run(self, formed: FormedPass, lane_passes: list[LanePass]) -> Work | None:
        """Runs one pass and returns the next one's work when it can start at once. Only
        what decides that next pass is done before it: the deliveries, posts, report and
        counters are settled by the outbox thread while it runs."""
        requests = formed.requests
        started = time.perf_counter()
        results, lane_outputs = self._forward(requests, lane_passes)
        ended = time.perf_counter()
        wall = time.time()
        self.last_seconds = seconds = ended - started
        effects: list[Effects] = []
        with self._lock:
            completing = time.perf_counter()
            self.former.pass_finished(seconds, ended)
            if lane_passes:
                effects.append(self.lanes.completed(lane_passes, lane_outputs))
            if requests:
                self._requests_ended(requests, results, effects)
            self._times["complete"] += time.perf_counter() - completing
            taken, _ = self._next_work()
        settle = functools.partial(
            self._settle, formed, lane_passes, results, lane_outputs, effects, seconds, wall
        )
        # When the next pass starts at once, the outbox settles this one while it runs;
        # otherwise this thread does it now, after anything the outbox still holds.
        if taken is not None or not self._outbox.idle():
            self._outbox.put(settle)
        else:
            settle()
        return taken

    def _requests_ended(
        self,
        requests: Sequence[ForwardRequest],
        results: list[list[SlotOutput] | Exception],
        effects: list[Effects],
    ) -> None:
        """Forgets what is left of a request whose chunk failed, and opens the lanes of the
        leases granted (the caller holds `cond`)."""
        for request, result in zip(requests, results, strict=True):
            failed = isinstance(result, Exception)
            if failed and not request.final:
                self.former.drop(request.corr)
            if request.lease is not None and (request.final or failed):
                output = result[-1] if isinstance(result, list) and result else None
                effects.append(self.lanes.opened(request.lease, output))

    def _settle(
        self,
        formed: FormedPass,
        lane_passes: list[LanePass],
        results: list[list[SlotOutput] | Exception],
        lane_outputs: Sequence[SlotOutput | None],
        effects: list[Effects],
        seconds: float,
        wall: float,
    ) -> None:
        """Deliveries, posts, the report, counters and observers of a pass that took
        `seconds` and ended at `wall`."""
        settling = time.perf_counter()
        requests = formed.requests
        self.passes += 1
        self.lane_passes += len(lane_passes)
        self.busy_seconds += seconds
        tokens = len(lane_passes) + sum(len(r.tokens) for r in requests)
        self.tokens += tokens
        for batch in effects:
            self.lanes.run(batch)
        if requests:
            self._report(PassReport(formed.batch, requests, results, seconds))
        if self._observers:
            failed = sum(isinstance(r, Exception) for r in results)
            failed += sum(out is None for out in lane_outputs)
            summary = PassSummary(
                number=self.passes,
                ended=wall,
                seconds=seconds,
                requests=len(requests),
                lane_passes=len(lane_passes),
                tokens=tokens,
                corrs=tuple(r.corr for r in requests),
                failed=failed,
                requesters=_requesters(requests, lane_passes),
            )
            self._tell(summary)
        self._settle_seconds += time.perf_counter() - settling

    def _tell(self, summary: PassSummary) -> None:
        for observer in self._observers:
            try:
                observer(summary)
            except Exception:  # a broken observer must not stop the passes
                traceback.print_exc(file=sys.stderr)
                self._observers = tuple(o for o in self._observers if o is not observer)

    def _forward(
        self, requests: Sequence[ForwardRequest], lane_passes: Sequence[LanePass]
    ) -> tuple[list[list[SlotOutput] | Exception], Sequence[SlotOutput | None]]:
        """Runs the requests and lane passes in one pass: each request's outputs (or what
        failed it) and each lane pass's output (None: it failed). When the driver refuses
        the batch, its parts run one by one so that only the culprit fails (the driver
        checks a batch before writing any KV)."""
        assembling = time.perf_counter()
        batch = _batch(requests, lane_passes)
        forwarding = time.perf_counter()
        self._times["assemble"] += forwarding - assembling
        try:
            outputs = self.driver.forward(batch)
        except Exception as err:
            self._times["forward"] += time.perf_counter() - forwarding
            if len(requests) + len(lane_passes) == 1:
                return [err] * len(requests), [None] * len(lane_passes)
            results: list[list[SlotOutput] | Exception] = []
            for request in requests:
                results.extend(self._forward((request,), ())[0])
            lane_outputs: list[SlotOutput | None] = []
            for lane_pass in lane_passes:
                lane_outputs.extend(self._forward((), (lane_pass,))[1])
            return results, lane_outputs
        self._times["forward"] += time.perf_counter() - forwarding
        if not requests:
            return [], outputs
        results = []
        cursor = 0
        for request in requests:
            count = len(request.slots)
            results.append(outputs[cursor : cursor + count])
            cursor += count
        return results, list(outputs[cursor:]) if lane_passes else []


class _Outbox:
    """A thread that runs what it is handed, in order. Handing work over is one call into a
    C queue: it sits on the pass loop's path from one pass to the next."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._handed = 0
        """Written by the handing thread only."""
        self._done = 0
        """Written by the outbox thread only."""

    def start(self) -> None:
        threading.Thread(target=self._main, name="pie-pass-outbox", daemon=True).start()

    def stop(self) -> None:
        self._work.put(None)

    def put(self, work: Callable[[], None]) -> None:
        self._handed += 1
        self._work.put(work)

    def idle(self) -> bool:
        """Whether everything handed over has run (asked by the handing thread)."""
        return self._done == self._handed

    def _main(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            try:
                work()
            except Exception:
                traceback.print_exc(file=sys.stderr)
            finally:
                self._done += 1


def _requesters(
    requests: Sequence[ForwardRequest], lane_passes: Sequence[LanePass]
) -> tuple[str, ...]:
    given = [r.requester for r in requests] + [p.lane.lease.requester for p in lane_passes]
    return tuple(dict.fromkeys(given))


def _batch(requests: Sequence[ForwardRequest], lane_passes: Sequence[LanePass]) -> ForwardBatch:
    batch = ForwardBatch()
    for request in requests:
        batch.add(request)
    for p in lane_passes:
        lane = p.lane
        lease = lane.lease
        batch.add_decode(
            p.token,
            p.position,
            lane.pages_for(p.slot),
            p.slot + 1,
            lease.masked_pages,
            p.op,
            lease.adapter,
        )
    return batch
