"""The pass loop: the one thread that calls the driver.

The batch former (former.py) decides what each pass holds and when it fires: placed requests
from the kv actor and queued lane passes (lanes.py) alike. When a pass ends, staged passes are
queued and the next pass starts at once when the former says so; lane results reach their
programs, and what the kv actor placed reaches the Trio thread as one `PassReport`, from the
outbox thread while that next pass runs. A speaking model's speech requests (speech.py) take one
step after each pass, or while no pass is due.

With a driver that launches passes without waiting for them (`launch` and `collect`) and lanes
that chain (`Lanes.chain`), a pass is launched and, before it is collected, the lane passes
WAITING for its tokens are launched as the next pass, reading those tokens on the device: the
device runs one pass while the host builds the next. A pass the former fires is launched in
the same way, behind whatever is on the device.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from attrs import define

from pie.dataplane.former import BatchFormer, BatchStatistics, FormedPass
from pie.dataplane.lanes import Effects, LanePass, Lanes
from pie.dataplane.passes import (
    Outbox,
    PassObserver,
    PassReport,
    PassSummary,
    PassTimes,
    build_batch,
    requesters,
    split_outputs,
)
from pie.dataplane.speech import SpeechDesk
from pie.drivers.base import Driver
from pie.drivers.batch import ForwardBatch
from pie.events.forward import ForwardRequest
from pie.events.sampling import SlotOutput

__all__ = ["PassLoop", "PassObserver", "PassReport", "PassSummary", "PassTimes"]

Work = tuple[FormedPass, list[LanePass]]
Results = list[list[SlotOutput] | Exception]


@define(eq=False)
class _Flight:
    """A pass on its way through the driver: launched (`launched`, the driver's handle), or
    already run to its end (`results` and `lane_outputs`)."""

    formed: FormedPass
    lane_passes: list[LanePass]
    started: float
    chained: bool = False
    """Made of lane passes chained on the pass before it; the former did not form it."""
    launched: Any = None
    results: Results | None = None
    lane_outputs: Sequence[SlotOutput | None] = ()
    unchained: list[LanePass] = attrs.field(factory=list)
    """Passes that were to follow this one on the device but could not be launched: they
    fail when this one lands."""


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
        self._outbox = Outbox()
        self._observers: tuple[PassObserver, ...] = ()
        self._launch: Callable[..., Any] | None = getattr(driver, "launch", None)
        self._chaining = lanes.chain and self._launch is not None
        self._flights: collections.deque[_Flight] = collections.deque()
        """Passes launched and not yet collected, oldest first (two at most)."""

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
        flights = self._flights
        while True:
            if taken is None and not flights:
                with self._cond:
                    taken = self._wait_for_work()
                if taken is None and self._stopping:
                    return
            try:
                if taken is not None:
                    flights.append(self._start(*taken))
                    taken = None
                if flights:
                    taken = self._land(flights.popleft())
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

    def _start(
        self,
        formed: FormedPass,
        lane_passes: list[LanePass],
        sources: Sequence[int] = (),
        after: _Flight | None = None,
    ) -> _Flight:
        """Launches a pass (runs it to its end when the driver cannot launch, or refuses the
        batch). `sources`: for each lane pass, the slot of `after`, on the device, whose token
        it reads there (chained passes only)."""
        started = time.perf_counter()
        flight = _Flight(formed, lane_passes, started, chained=bool(sources))
        batch = build_batch(formed.requests, lane_passes, sources)
        launching = time.perf_counter()
        self._times["assemble"] += launching - started
        if self._launch is not None:
            try:
                flight.launched = self._launch(batch, None if after is None else after.launched)
            except Exception:
                if sources:
                    raise
            else:
                self._times["forward"] += time.perf_counter() - launching
                return flight
        flight.results, flight.lane_outputs = self._forward(formed.requests, lane_passes, batch)
        return flight

    def _chain(self, flight: _Flight) -> None:
        """Launches the lane passes waiting for `flight`'s tokens (it is on the device) as the
        next pass."""
        with self._lock:
            chained = self.lanes.take_chained(flight.lane_passes)
        if not chained:
            return
        base = sum(len(r.slots) for r in flight.formed.requests)
        followers = [p for p, _ in chained]
        formed = FormedPass(batch=0, requests=(), lanes=len(followers))
        try:
            sources = [base + i for _, i in chained]
            self._flights.append(self._start(formed, followers, sources, flight))
        except Exception:  # a chain the driver refuses is a bug: its passes fail, nothing else
            traceback.print_exc(file=sys.stderr)
            flight.unchained = followers

    def _land(self, flight: _Flight) -> Work | None:
        """Collects a pass (chaining its followers on the device first), completes it, and
        returns the next pass's work when it can start at once. Only what decides that next
        pass is done before it: the deliveries, posts, report and counters are settled by the
        outbox thread while it runs."""
        if self._chaining and flight.launched is not None and not self._flights:
            self._chain(flight)
        results, lane_outputs = self._collect(flight)
        requests, lane_passes = flight.formed.requests, flight.lane_passes
        ended = time.perf_counter()
        wall = time.time()
        self.last_seconds = seconds = ended - flight.started
        effects: list[Effects] = []
        with self._lock:
            completing = time.perf_counter()
            if not flight.chained:
                self.former.pass_finished(seconds, ended)
            if lane_passes:
                effects.append(self.lanes.completed(lane_passes, lane_outputs))
            if flight.unchained:
                failed = [None] * len(flight.unchained)
                effects.append(self.lanes.completed(flight.unchained, failed))
            if requests:
                self._requests_ended(requests, results, effects)
            self._times["complete"] += time.perf_counter() - completing
            taken, _ = self._next_work()
        settle = functools.partial(
            self._settle, flight.formed, lane_passes, results, lane_outputs, effects, seconds, wall
        )
        # When the next pass starts at once, the outbox settles this one while it runs;
        # otherwise this thread does it now, after anything the outbox still holds.
        if taken is not None or self._flights or not self._outbox.idle():
            self._outbox.put(settle)
        else:
            settle()
        return taken

    def _collect(self, flight: _Flight) -> tuple[Results, Sequence[SlotOutput | None]]:
        if flight.results is not None:
            return flight.results, flight.lane_outputs
        collecting = time.perf_counter()
        requests, lane_passes = flight.formed.requests, flight.lane_passes
        try:
            outputs = self.driver.collect(flight.launched)  # type: ignore[attr-defined]
        except Exception as err:  # the device failed the pass: everything in it fails
            traceback.print_exc(file=sys.stderr)
            return [err] * len(requests), [None] * len(lane_passes)
        finally:
            self._times["forward"] += time.perf_counter() - collecting
        return split_outputs(requests, lane_passes, outputs)

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
                requesters=requesters(requests, lane_passes),
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
        self,
        requests: Sequence[ForwardRequest],
        lane_passes: Sequence[LanePass],
        batch: ForwardBatch | None = None,
    ) -> tuple[Results, Sequence[SlotOutput | None]]:
        """Runs the requests and lane passes in one pass: each request's outputs (or what
        failed it) and each lane pass's output (None: it failed). When the driver refuses
        the batch, its parts run one by one so that only the culprit fails (the driver
        checks a batch before writing any KV)."""
        if batch is None:
            batch = build_batch(requests, lane_passes)
        forwarding = time.perf_counter()
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
        return split_outputs(requests, lane_passes, outputs)
