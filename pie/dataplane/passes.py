"""What the pass loop (loop.py) hands out about its passes: the report of the requests a pass
ran, the summary its observers get, the time spent in each part, and the outbox thread that
settles a pass while the next one runs; and how it builds a pass's batch and cuts its outputs."""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

from attrs import define, frozen

from pie.dataplane.lanes import LanePass
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


class Outbox:
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


def requesters(
    requests: Sequence[ForwardRequest], lane_passes: Sequence[LanePass]
) -> tuple[str, ...]:
    given = [r.requester for r in requests] + [p.lane.lease.requester for p in lane_passes]
    return tuple(dict.fromkeys(given))


def split_outputs(
    requests: Sequence[ForwardRequest],
    lane_passes: Sequence[LanePass],
    outputs: list[SlotOutput],
) -> tuple[list[list[SlotOutput] | Exception], Sequence[SlotOutput | None]]:
    """A pass's outputs cut into each request's, then the lane passes'."""
    if not requests:
        return [], outputs
    results: list[list[SlotOutput] | Exception] = []
    cursor = 0
    for request in requests:
        count = len(request.slots)
        results.append(outputs[cursor : cursor + count])
        cursor += count
    return results, list(outputs[cursor:]) if lane_passes else []


def build_batch(
    requests: Sequence[ForwardRequest],
    lane_passes: Sequence[LanePass],
    sources: Sequence[int] = (),
) -> ForwardBatch:
    """The driver's batch: the requests, then one decode per lane pass, chained on slot
    `sources[i]` of the pass before when sources are given."""
    batch = ForwardBatch()
    for request in requests:
        batch.add(request)
    for i, p in enumerate(lane_passes):
        lane = p.lane
        lease = lane.lease
        batch.add_decode(
            max(p.token, 0),
            p.position,
            lane.pages_for(p.slot),
            p.slot + 1,
            lease.masked_pages,
            p.op,
            lease.adapter,
            chained_from=sources[i] if sources else None,
        )
    return batch
