"""The inference actor: the Trio face of the data plane. Placed requests go to the pass loop
(pie/dataplane/loop.py), and what each pass produced comes back to be routed."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import trio
from attrs import frozen

from pie.actors.runtime import Actor, Router
from pie.dataplane import (
    BatchFormer,
    BatchStatistics,
    Lanes,
    PassLoop,
    PassObserver,
    PassReport,
    PassTimes,
    SpeechDesk,
)
from pie.drivers.base import Driver, DriverError
from pie.events.batching import ForwardCompleted, ScheduleForward
from pie.events.forward import ForwardRequest
from pie.events.kv import PassApplied, RequestFailed
from pie.events.sampling import SlotOutput


@frozen(kw_only=True)
class InferenceStatistics:
    passes: int
    lane_passes: int
    tokens: int
    failed_requests: int
    busy_seconds: float
    last_pass_seconds: float
    pass_times: PassTimes
    """Seconds spent in each part of the passes so far (form, assemble, forward, complete,
    settle): the host's share of a pass beside the driver's."""


class InferenceActor(Actor):
    """Hands the pass loop what the kv actor placed and routes what each pass produced
    (outputs to requesters, commits to the kv actor). Lane passes never come through here;
    their events arrive already made, through `post`."""

    accepts = ScheduleForward

    def __init__(
        self,
        driver: Driver,
        router: Router,
        lanes: Lanes,
        former: BatchFormer,
        *,
        kv: str = "kv",
        address: str = "inference",
        speech: SpeechDesk | None = None,
    ) -> None:
        super().__init__(address, router, capacity=65536)
        self.kv = kv
        self._loop = PassLoop(driver, lanes, former, self._from_thread, speech)
        self._token: trio.lowlevel.TrioToken | None = None
        self._partial: dict[int, list[tuple[int, SlotOutput]]] = {}
        self._failures = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._loop.start()
        try:
            await super().run(task_status=task_status)
        finally:
            self._loop.stop()

    def post(self, events: list[tuple[str, Any]]) -> None:
        """Sends events made on another thread, in order, from this address (any thread)."""
        assert self._token is not None, "the inference actor is not running"
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._route, events)

    def _route(self, events: list[tuple[str, Any]]) -> None:
        for dst, event in events:
            self.router.send_nowait(self.address, dst, event)

    def _from_thread(self, report: PassReport) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._finished, report)

    async def handle(self, event: Any) -> None:
        self._loop.submit(event.request)

    def handler_failed(self, event: Any, exc: Exception) -> None:
        """A request that could not be handed to the data plane fails like a failed pass:
        the kv actor and its requester both hear of it."""
        super().handler_failed(event, exc)
        self._fail(event.request, exc, kind="internal")

    def _finished(self, report: PassReport) -> None:
        """A pass that ran placed requests ended (Trio thread)."""
        for request, result in zip(report.requests, report.results, strict=True):
            if isinstance(result, Exception):
                self._fail(request, result)
            else:
                self._deliver(request, result)

    def _deliver(self, request: ForwardRequest, mine: list[SlotOutput]) -> None:
        order = request.slot_positions or range(len(request.slots))
        self._partial.setdefault(request.corr, []).extend(zip(order, mine, strict=True))
        if request.final:
            gathered = sorted(self._partial.pop(request.corr), key=lambda pair: pair[0])
            reply = ForwardCompleted(
                corr=request.corr,
                context=request.context,
                outputs=tuple(out for _, out in gathered),
            )
            self.router.send_nowait(
                self.address, self.kv, PassApplied(corr=request.corr, context=request.context)
            )
            self.router.send_nowait(self.address, request.requester, reply)

    def _fail(self, request: ForwardRequest, err: Exception, kind: str | None = None) -> None:
        self._failures += 1
        if kind is None:
            kind = "invalid" if isinstance(err, DriverError) else "driver"
        if kind == "driver":
            print(f"pie: forward pass failed: {err!r}", file=sys.stderr)
        self._partial.pop(request.corr, None)
        failed = RequestFailed(corr=request.corr, kind=kind, message=str(err))
        self.router.send_nowait(
            self.address, self.kv, PassApplied(corr=request.corr, context=request.context, ok=False)
        )
        self.router.send_nowait(self.address, request.requester, failed)

    def statistics(self) -> InferenceStatistics:
        loop = self._loop
        return InferenceStatistics(
            passes=loop.passes,
            lane_passes=loop.lane_passes,
            tokens=loop.tokens,
            failed_requests=self._failures,
            busy_seconds=loop.busy_seconds,
            last_pass_seconds=loop.last_seconds,
            pass_times=loop.pass_times(),
        )

    def batch_statistics(self) -> BatchStatistics:
        return self._loop.batch_statistics()

    def observe_passes(self, observer: PassObserver) -> None:
        """Tells `observer` about every pass after it ran (on the data plane's threads)."""
        self._loop.observe(observer)
