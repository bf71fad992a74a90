"""A batch former that also records what it is asked and answers (its clock readings and lane
counts are inputs), handing each pass's steps to a sink, so that the event log can replay the
former's decisions exactly."""

from __future__ import annotations

from collections.abc import Callable

from pie.dataplane.former import NO_LANES, BatchFormer, BatchPolicy, FormedPass, LaneView
from pie.events.batching import (
    FormerDeadline,
    FormerDrop,
    FormerFinished,
    FormerNext,
    FormerStep,
    FormerSubmit,
)
from pie.events.forward import ForwardRequest

StepSink = Callable[[tuple[FormerStep, ...]], None]


class RecordingFormer(BatchFormer):
    """Every call is made under the pass loop's lock, so the steps are in the order the
    former saw them. They go to `sink` at the end of each pass (and on `flush`)."""

    def __init__(self, policy: BatchPolicy, sink: StepSink) -> None:
        super().__init__(policy)
        self._sink = sink
        self._steps: list[FormerStep] = []

    def submit(self, request: ForwardRequest, now: float) -> None:
        self._steps.append(FormerSubmit(corr=request.corr, now=now))
        super().submit(request, now)

    def drop(self, corr: int) -> None:
        self._steps.append(FormerDrop(corr=corr))
        super().drop(corr)

    def pass_finished(self, seconds: float, now: float = 0.0) -> None:
        self._steps.append(FormerFinished(seconds=seconds, now=now))
        super().pass_finished(seconds, now)
        self.flush()

    def deadline(self, lanes: LaneView = NO_LANES) -> float | None:
        at = super().deadline(lanes)
        self._steps.append(FormerDeadline(ready=lanes.ready, awaited=bool(lanes.awaited), at=at))
        return at

    def next_batch(self, now: float, lanes: LaneView = NO_LANES) -> FormedPass | None:
        ready, awaited = lanes.ready, bool(lanes.awaited)
        formed = super().next_batch(now, lanes)
        self._steps.append(next_step(now, ready, awaited, formed))
        return formed

    def flush(self) -> None:
        """Hands the steps recorded since the last flush to the sink."""
        if self._steps:
            steps, self._steps = tuple(self._steps), []
            self._sink(steps)


def next_step(now: float, ready: int, awaited: bool, formed: FormedPass | None) -> FormerNext:
    """The record of a `next_batch` call and its answer."""
    if formed is None:
        return FormerNext(now=now, ready=ready, awaited=awaited)
    requests = tuple((r.corr, len(r.tokens), r.final) for r in formed.requests)
    return FormerNext(
        now=now,
        ready=ready,
        awaited=awaited,
        batch=formed.batch,
        requests=requests,
        lanes=formed.lanes,
    )
