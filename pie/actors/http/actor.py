"""Runs each `HttpFetch` as a task of its own and answers its requester with `HttpFetched` or
a `RequestFailed` (denied, invalid, timeout, too-large, unreachable, protocol; `busy` when the
inferlet or its user already has as many requests in flight as `[network]` allows; `internal`
when the request failed in a way the engine did not foresee). Forward passes never wait on
these: the requester's program waits on its own pollable, and no request's failure reaches
the actor or the engine."""

from __future__ import annotations

import sys
import traceback
from typing import Any

import attrs
import trio
from attrs import define

from pie.actors.runtime import Actor, MailboxOverrun, Router, UnexpectedEvent
from pie.events.http import HttpFetch, HttpFetched
from pie.events.kv import RequestFailed
from pie.net.fetch import Fetcher, FetchError
from pie.net.quota import FetchAdmission, FetchQuota


@define
class HttpStatistics:
    requests: int = 0
    responses: int = 0
    failures: int = 0
    denied: int = 0
    refused_busy: int = 0
    running: int = 0
    bytes_received: int = 0


class HttpActor(Actor):
    accepts = HttpFetch

    def __init__(
        self, fetcher: Fetcher, router: Router, quota: FetchQuota, address: str = "http"
    ) -> None:
        super().__init__(address, router)
        self.fetcher = fetcher
        self._admission = FetchAdmission(quota)
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
        refused = self._admission.admit(event.requester, event.user)
        if refused is not None:
            self._stats.failures += 1
            self._stats.refused_busy += 1
            self._reply(event, RequestFailed(corr=event.corr, kind="busy", message=refused))
            return
        self._stats.running += 1
        self._nursery.start_soon(self._fetch, event)

    async def _fetch(self, request: HttpFetch) -> None:
        try:
            reply = await self._answer(request)
        finally:
            self._stats.running -= 1
            self._admission.release(request.requester, request.user)
        self._reply(request, reply)

    async def _answer(self, request: HttpFetch) -> HttpFetched | RequestFailed:
        try:
            response = await self.fetcher.fetch(
                request.method,
                request.url,
                request.headers,
                request.body,
                timeout_seconds=request.timeout_seconds,
                max_redirects=request.max_redirects,
                corr=request.corr,
            )
        except FetchError as exc:
            self._stats.failures += 1
            self._stats.denied += exc.kind == "denied"
            return RequestFailed(corr=request.corr, kind=exc.kind, message=exc.message)
        except Exception as exc:  # one request's surprise must not stop the engine
            self._stats.failures += 1
            print(
                f"{self.address}: {request.method} {request.url!r} failed",
                "".join(traceback.format_exception(exc)),
                file=sys.stderr,
                sep="\n",
            )
            message = "the engine failed on this request (the server's log has the details)"
            return RequestFailed(corr=request.corr, kind="internal", message=message)
        self._stats.responses += 1
        self._stats.bytes_received += len(response.body)
        return HttpFetched(
            corr=request.corr,
            status=response.status,
            url=response.url,
            headers=response.headers,
            body=response.body,
        )

    def _reply(self, request: HttpFetch, reply: HttpFetched | RequestFailed) -> None:
        try:
            self.router.send_nowait(self.address, request.requester, reply)
        except (MailboxOverrun, UnexpectedEvent) as exc:
            print(f"{self.address}: no answer to {request.requester}: {exc}", file=sys.stderr)

    def statistics(self) -> HttpStatistics:
        return attrs.evolve(self._stats)
