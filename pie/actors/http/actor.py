"""Runs each `HttpFetch` as a task of its own and answers its requester with `HttpFetched` or
a `RequestFailed` (denied, invalid, timeout, too-large, unreachable, protocol). Forward passes
never wait on these: the requester's program waits on its own pollable."""

from __future__ import annotations

from typing import Any

import attrs
import trio
from attrs import define

from pie.actors.runtime import Actor, Router
from pie.events.http import HttpFetch, HttpFetched
from pie.events.kv import RequestFailed
from pie.net.fetch import Fetcher, FetchError


@define
class HttpStatistics:
    requests: int = 0
    responses: int = 0
    failures: int = 0
    denied: int = 0
    running: int = 0
    bytes_received: int = 0


class HttpActor(Actor):
    accepts = HttpFetch

    def __init__(self, fetcher: Fetcher, router: Router, address: str = "http") -> None:
        super().__init__(address, router)
        self.fetcher = fetcher
        self._stats = HttpStatistics()
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await super().run(task_status=task_status)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self.fetcher.aclose()

    async def handle(self, event: Any) -> None:
        if not isinstance(event, HttpFetch):
            raise TypeError(f"http actor got an unexpected event {type(event).__name__}")
        assert self._nursery is not None
        self._stats.requests += 1
        self._stats.running += 1
        self._nursery.start_soon(self._fetch, event)

    async def _fetch(self, request: HttpFetch) -> None:
        reply: Any
        try:
            response = await self.fetcher.fetch(
                request.method,
                request.url,
                request.headers,
                request.body,
                timeout_seconds=request.timeout_seconds,
                max_redirects=request.max_redirects,
            )
        except FetchError as exc:
            self._stats.failures += 1
            self._stats.denied += exc.kind == "denied"
            reply = RequestFailed(corr=request.corr, kind=exc.kind, message=exc.message)
        else:
            self._stats.responses += 1
            self._stats.bytes_received += len(response.body)
            reply = HttpFetched(
                corr=request.corr,
                status=response.status,
                url=response.url,
                headers=response.headers,
                body=response.body,
            )
        finally:
            self._stats.running -= 1
        self.router.send_nowait(self.address, request.requester, reply)

    def statistics(self) -> HttpStatistics:
        return attrs.evolve(self._stats)
