"""The inference actor: the scheduler's batches go to the pass loop (loop.py), and what each
pass produced comes back to be routed."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import trio
from attrs import frozen

from pie.actors.inference.loop import PassLoop, PassReport
from pie.actors.runtime import Actor, Router
from pie.actors.speculator.lanes import Lanes
from pie.drivers.base import Driver, DriverError
from pie.events.batching import ExecuteBatch, ForwardCompleted, PassFinished
from pie.events.forward import ForwardRequest
from pie.events.kv import PassApplied, RequestFailed
from pie.events.sampling import SlotOutput
from pie.events.speculation import LeaseReleased


@frozen(kw_only=True)
class InferenceStatistics:
    passes: int
    lane_passes: int
    tokens: int
    failed_requests: int
    busy_seconds: float
    last_pass_seconds: float


class InferenceActor(Actor):
    """The Trio face of the pass loop: hands it the scheduler's batches and routes what each
    pass produced (outputs to requesters, commits to the kv actor, timings to the scheduler).
    Lane passes never come through here; their events arrive already made, through `route`."""

    accepts = ExecuteBatch

    def __init__(
        self,
        driver: Driver,
        router: Router,
        lanes: Lanes,
        *,
        max_requests: int,
        max_tokens: int,
        kv: str = "kv",
        scheduler: str = "scheduler",
        address: str = "inference",
    ) -> None:
        super().__init__(address, router, capacity=64)
        self.driver = driver
        self.lanes = lanes
        self.kv = kv
        self.scheduler = scheduler
        self._limits = (max_requests, max_tokens)
        self._loop: PassLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._partial: dict[int, list[tuple[int, SlotOutput]]] = {}
        self._failed: set[int] = set()
        self._failures = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._loop = PassLoop(
            self.driver,
            self.lanes,
            self._from_thread,
            max_requests=self._limits[0],
            max_tokens=self._limits[1],
        )
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
        if not isinstance(event, ExecuteBatch):
            raise TypeError(f"inference actor got an unexpected event {type(event).__name__}")
        requests = self._drop_failed(event.requests)
        if not requests:
            finished = PassFinished(batch=event.batch, seconds=0.0, requests=0, tokens=0)
            self.router.send_nowait(self.address, self.scheduler, finished)
            return
        assert self._loop is not None
        self._loop.execute(event.batch, requests)

    def _finished(self, report: PassReport) -> None:
        """A pass that carried the scheduler's batch ended (Trio thread)."""
        for request, result in zip(report.requests, report.results, strict=True):
            if isinstance(result, Exception):
                self._fail(request, result)
            else:
                self._deliver(request, result)
        assert report.batch is not None
        tokens = sum(len(r.tokens) for r in report.requests)
        finished = PassFinished(
            batch=report.batch, seconds=report.seconds, requests=len(report.requests), tokens=tokens
        )
        self.router.send_nowait(self.address, self.scheduler, finished)

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

    def _fail(self, request: ForwardRequest, err: Exception) -> None:
        self._failures += 1
        kind = "invalid" if isinstance(err, DriverError) else "driver"
        if kind == "driver":
            print(f"pie: forward pass failed: {err!r}", file=sys.stderr)
        self._partial.pop(request.corr, None)
        if not request.final:
            self._failed.add(request.corr)
        failed = RequestFailed(corr=request.corr, kind=kind, message=str(err))
        self.router.send_nowait(
            self.address, self.kv, PassApplied(corr=request.corr, context=request.context, ok=False)
        )
        self.router.send_nowait(self.address, request.requester, failed)

    def _drop_failed(self, requests: Sequence[ForwardRequest]) -> list[ForwardRequest]:
        """Later chunks of a request that already failed are skipped, never written."""
        kept = []
        for request in requests:
            if request.corr in self._failed:
                if request.final:
                    self._failed.discard(request.corr)
                    if request.lease is not None:
                        released = LeaseReleased(lease=request.lease.lease, context=request.context)
                        self.router.send_nowait(self.address, self.kv, released)
                continue
            kept.append(request)
        return kept

    def statistics(self) -> InferenceStatistics:
        loop = self._loop
        return InferenceStatistics(
            passes=loop.passes if loop else 0,
            lane_passes=loop.lane_passes if loop else 0,
            tokens=loop.tokens if loop else 0,
            failed_requests=self._failures,
            busy_seconds=loop.busy_seconds if loop else 0.0,
            last_pass_seconds=loop.last_seconds if loop else 0.0,
        )
