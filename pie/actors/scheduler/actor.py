"""The scheduler's Trio shell: queues placed requests and fires batches at the inference actor
when the core's rule says so (waking itself at the core's deadline)."""

from __future__ import annotations

from typing import Any

import trio

from pie.actors.runtime import Actor, Router
from pie.actors.scheduler.core import SchedulerCore, SchedulerStatistics
from pie.events.batching import PassFinished, ScheduleForward


class SchedulerActor(Actor):
    accepts = ScheduleForward | PassFinished

    def __init__(
        self,
        core: SchedulerCore,
        router: Router,
        *,
        inference: str = "inference",
        address: str = "scheduler",
    ) -> None:
        super().__init__(address, router, capacity=65536)
        self.core = core
        self.inference = inference

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            while True:
                deadline = self.core.deadline()
                with trio.move_on_at(deadline if deadline is not None else float("inf")):
                    try:
                        event = await self._inbox.receive()
                    except trio.EndOfChannel:
                        return
                    await self.handle(event)
                    await self._drain()
                self._fire()

    async def _drain(self) -> None:
        # Decide on everything that already arrived, not on the first event of a burst.
        while True:
            try:
                event = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            await self.handle(event)

    async def handle(self, event: Any) -> None:
        match event:
            case ScheduleForward(request=request):
                self.core.submit(request, trio.current_time())
            case PassFinished(seconds=seconds):
                self.core.pass_finished(seconds, trio.current_time())
            case _:
                raise TypeError(f"scheduler got an unexpected event {type(event).__name__}")

    def _fire(self) -> None:
        batch = self.core.next_batch(trio.current_time())
        if batch is not None:
            self.router.send_nowait(self.address, self.inference, batch)

    def statistics(self) -> SchedulerStatistics:
        return self.core.statistics()
