"""The inferlet's asyncio event loop: when no callback is ready it blocks in ONE host
`futures.poll` over every pending host future, so concurrent branches batch together."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from wit_world.imports import futures

from inferlet.errors import call


class _PollSelector:
    """Stands in for asyncio's I/O selector: the loop's only "I/O" is host futures."""

    def __init__(self) -> None:
        self.waiting: dict[int, asyncio.Future[None]] = {}

    def select(self, timeout: float | None) -> list[Any]:
        if timeout == 0:
            return []
        if not self.waiting:
            if timeout is None:
                raise RuntimeError(
                    "the inferlet is waiting for something that can never happen: no host "
                    "future (forward pass, message, child) is pending and no timer is set"
                )
            time.sleep(timeout)
            return []
        # poll has no timeout: a due timer waits for the next host future (it never fires early).
        handles = list(self.waiting)
        for index in call(futures.poll, handles):
            waiter = self.waiting.pop(handles[index])
            if not waiter.done():
                waiter.set_result(None)
        return []


class InferletLoop(asyncio.BaseEventLoop):
    """asyncio's own loop (tasks, timers, gather) with host futures as its selector."""

    def __init__(self) -> None:
        super().__init__()
        self._selector = _PollSelector()

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def host_future(self, handle: int) -> asyncio.Future[None]:
        """An asyncio future that resolves when host future `handle` is ready."""
        waiter: asyncio.Future[None] = self.create_future()
        self._selector.waiting[handle] = waiter
        waiter.add_done_callback(lambda done: self._forget(handle, done))
        return waiter

    def idle(self) -> bool:
        """No callback ready, no timer set and no other host future pending."""
        return not (self._ready or self._scheduled or self._selector.waiting)  # type: ignore[attr-defined]

    def _forget(self, handle: int, waiter: asyncio.Future[None]) -> None:
        if waiter.cancelled() and self._selector.waiting.pop(handle, None) is not None:
            futures.discard(handle)


def idle() -> bool:
    """Whether nothing else on the inferlet's loop could run while this task waits: then a host
    call may block the thread (one call in place of a submit, a poll and a read)."""
    loop = asyncio.get_running_loop()
    return isinstance(loop, InferletLoop) and loop.idle()


async def ready(handle: int) -> None:
    """Waits (without blocking other tasks) until host future `handle` is ready."""
    loop = asyncio.get_running_loop()
    if not isinstance(loop, InferletLoop):
        raise RuntimeError("inferlet code must run on the inferlet event loop (use main())")
    if loop.idle():
        # Nothing else could run meanwhile, so the loop would make this very poll; making it
        # here skips a trip through the loop's machinery on every decode step.
        call(futures.poll, [handle])
        return
    await loop.host_future(handle)


def run(coro: Any) -> Any:
    """Runs `coro` to completion on a fresh InferletLoop, then cancels what it left running."""
    loop = InferletLoop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_leftovers(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_leftovers(loop: InferletLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
