"""Runs each ExecuteBatch on the driver in a worker thread and routes the results: outputs to
requesters, commits to the kv actor, pass timings to the scheduler."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import trio
from attrs import frozen

from pie.actors.runtime import Actor, Router
from pie.drivers.base import Driver, DriverError
from pie.drivers.batch import ForwardBatch
from pie.events.batching import ExecuteBatch, ForwardCompleted, PassFinished
from pie.events.forward import ForwardRequest
from pie.events.kv import PassApplied, RequestFailed
from pie.events.sampling import SlotOutput


@frozen(kw_only=True)
class InferenceStatistics:
    passes: int
    tokens: int
    failed_requests: int
    busy_seconds: float
    last_pass_seconds: float


class InferenceActor(Actor):
    def __init__(
        self,
        driver: Driver,
        router: Router,
        *,
        kv: str = "kv",
        scheduler: str = "scheduler",
        address: str = "inference",
    ) -> None:
        super().__init__(address, router, capacity=64)
        self.driver = driver
        self.kv = kv
        self.scheduler = scheduler
        self._limiter = trio.CapacityLimiter(1)
        self._partial: dict[int, list[tuple[int, SlotOutput]]] = {}
        self._failed: set[int] = set()
        self._passes = 0
        self._tokens = 0
        self._failures = 0
        self._busy = 0.0
        self._last = 0.0

    async def handle(self, event: Any) -> None:
        if not isinstance(event, ExecuteBatch):
            raise TypeError(f"inference actor got an unexpected event {type(event).__name__}")
        requests = self._drop_failed(event.requests)
        started = time.perf_counter()
        if requests:
            await self._run(requests)
        seconds = time.perf_counter() - started
        self._passes += 1
        self._busy += seconds
        self._last = seconds
        tokens = sum(len(r.tokens) for r in requests)
        self._tokens += tokens
        finished = PassFinished(
            batch=event.batch, seconds=seconds, requests=len(requests), tokens=tokens
        )
        self.router.send_nowait(self.address, self.scheduler, finished)

    async def _run(self, requests: Sequence[ForwardRequest]) -> None:
        try:
            outputs = await self._forward(requests)
        except Exception as err:
            if len(requests) == 1:
                self._fail(requests[0], err)
                return
            # Find the culprit: the driver checks a batch before writing any KV, so rerunning
            # the requests one by one is safe and fails only the bad one.
            for request in requests:
                await self._run([request])
            return
        self._deliver(requests, outputs)

    async def _forward(self, requests: Sequence[ForwardRequest]) -> list[SlotOutput]:
        batch = ForwardBatch.from_requests(requests)
        return await trio.to_thread.run_sync(self.driver.forward, batch, limiter=self._limiter)

    def _deliver(self, requests: Sequence[ForwardRequest], outputs: list[SlotOutput]) -> None:
        cursor = 0
        for request in requests:
            mine = outputs[cursor : cursor + len(request.slots)]
            cursor += len(request.slots)
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
                continue
            kept.append(request)
        return kept

    def statistics(self) -> InferenceStatistics:
        return InferenceStatistics(
            passes=self._passes,
            tokens=self._tokens,
            failed_requests=self._failures,
            busy_seconds=self._busy,
            last_pass_seconds=self._last,
        )
