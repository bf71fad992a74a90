"""Runs each tool listing and call as a task of its own against the configured MCP servers and
answers its requester with the result or a `RequestFailed` (no-such-server, denied,
no-such-tool, invalid, timeout, unavailable, tool-failed, too-large). Forward passes never wait
on these: the requester's program waits on its own pollable."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
from attrs import define, frozen

from pie.actors.mcp.results import McpFailure, called_event, parse_arguments, tool_event
from pie.actors.runtime import Actor, Router
from pie.config import McpConfig
from pie.events.kv import RequestFailed
from pie.events.mcp import (
    McpCallTool,
    McpListServers,
    McpListTools,
    McpServerList,
    McpToolCalled,
    McpToolList,
)

if TYPE_CHECKING:
    from pie.actors.mcp.link import ServerLink
    from pie.observe.tracing import Tracing


@frozen(kw_only=True)
class McpServerStatistics:
    name: str
    connected: bool
    starts: int
    """Sessions opened (a server restarted after its connection broke counts again)."""
    start_failures: int
    listings: int
    calls: int
    tool_errors: int
    """Calls the tool answered with `is_error`."""
    failures: int
    """Requests answered with an error."""


@frozen(kw_only=True)
class McpStatistics:
    listings: int
    calls: int
    failures: int
    running: int
    servers: tuple[McpServerStatistics, ...]


@define
class _Counts:
    listings: int = 0
    calls: int = 0
    tool_errors: int = 0
    failures: int = 0


class McpActor(Actor):
    accepts = McpListServers | McpListTools | McpCallTool

    def __init__(
        self,
        config: McpConfig,
        router: Router,
        address: str = "mcp",
        *,
        tracing: Tracing | None = None,
    ) -> None:
        """`tracing`: the engine's spans, when on; each traced request gets one."""
        super().__init__(address, router)
        self.config = config
        self.tracing = tracing
        self.links: dict[str, ServerLink] = {}
        if config.servers:
            # The MCP client stack takes a second to import: only an engine with servers loads it.
            from pie.actors.mcp.link import ServerLink

            self.links = {
                server.name: ServerLink(
                    server,
                    connect_seconds=config.connect_seconds,
                    retry_seconds=config.retry_seconds,
                )
                for server in config.servers
            }
        self._counts = {name: _Counts() for name in self.links}
        self._total = _Counts()
        self._running = 0
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await super().run(task_status=task_status)
            finally:
                for link in self.links.values():
                    link.close()
                # Each session's task stops its server as it ends (stdio: stdin closed, then
                # terminate, then kill; shielded and bounded by the mcp package).
                nursery.cancel_scope.cancel()

    async def handle(self, event: Any) -> None:
        assert self._nursery is not None
        match event:
            case McpListServers():
                names = tuple(n for n, link in self.links.items() if link.allows(event.user))
                reply = McpServerList(corr=event.corr, servers=names)
                self.router.send_nowait(self.address, event.requester, reply)
            case McpListTools() | McpCallTool():
                self._running += 1
                self._nursery.start_soon(self._serve, event)
            case _:
                raise TypeError(f"mcp actor got an unexpected event {type(event).__name__}")

    async def _serve(self, request: McpListTools | McpCallTool) -> None:
        counts = self._counts.get(request.server, _Counts())
        reply: Any
        try:
            reply = await self._traced(request, counts)
        except McpFailure as failure:
            counts.failures += 1
            self._total.failures += 1
            reply = RequestFailed(corr=request.corr, kind=failure.kind, message=failure.message)
        except Exception as exc:  # a bug or a library's surprise fails this call alone
            counts.failures += 1
            self._total.failures += 1
            self.handler_failed(request, exc)
            return
        finally:
            self._running -= 1
        self.router.send_nowait(self.address, request.requester, reply)

    async def _traced(
        self, request: McpListTools | McpCallTool, counts: _Counts
    ) -> McpToolList | McpToolCalled:
        """The answer, in a span under the program's call when that call is traced."""
        if self.tracing is None:
            return await self._answer_in_time(request, counts)
        shown = {"pie.mcp.server": request.server}
        if isinstance(request, McpCallTool):
            shown["pie.mcp.tool"] = request.tool
        with self.tracing.serving(request.corr, "pie.mcp.request", shown):
            return await self._answer_in_time(request, counts)

    async def _answer_in_time(
        self, request: McpListTools | McpCallTool, counts: _Counts
    ) -> McpToolList | McpToolCalled:
        timeout = self.config.timeout_seconds
        if isinstance(request, McpCallTool) and request.timeout_seconds is not None:
            timeout = min(timeout, max(0.0, request.timeout_seconds))
        with trio.move_on_after(timeout):
            if isinstance(request, McpListTools):
                return await self._list(request, counts)
            return await self._call(request, counts)
        raise McpFailure("timeout", f"{request.server!r} did not answer within {timeout:g} s")

    async def _list(self, request: McpListTools, counts: _Counts) -> McpToolList:
        counts.listings += 1
        self._total.listings += 1
        link = self._link(request.server, request.user)
        assert self._nursery is not None
        tools = await link.tools(self._nursery)
        return McpToolList(
            corr=request.corr, server=request.server, tools=tuple(map(tool_event, tools))
        )

    async def _call(self, request: McpCallTool, counts: _Counts) -> McpToolCalled:
        counts.calls += 1
        self._total.calls += 1
        link = self._link(request.server, request.user)
        arguments = parse_arguments(request.arguments)
        assert self._nursery is not None
        if not await link.has_tool(self._nursery, request.tool):
            raise McpFailure("no-such-tool", f"{request.server!r} has no tool {request.tool!r}")
        result = await link.call(self._nursery, request.tool, arguments)
        max_bytes = int(self.config.max_result_mb * (1 << 20))
        called = called_event(request.corr, result, max_bytes)
        counts.tool_errors += called.is_error
        return called

    def _link(self, server: str, user: str) -> ServerLink:
        link = self.links.get(server)
        if link is None:
            allowed = [name for name, each in self.links.items() if each.allows(user)]
            known = ", ".join(map(repr, allowed)) or "none"
            raise McpFailure("no-such-server", f"no mcp server {server!r} (configured: {known})")
        if not link.allows(user):
            raise McpFailure("denied", f"user {user!r} may not use mcp server {server!r}")
        return link

    def statistics(self) -> McpStatistics:
        return McpStatistics(
            listings=self._total.listings,
            calls=self._total.calls,
            failures=self._total.failures,
            running=self._running,
            servers=tuple(
                McpServerStatistics(
                    name=name,
                    connected=link.connected,
                    starts=link.starts,
                    start_failures=link.start_failures,
                    listings=self._counts[name].listings,
                    calls=self._counts[name].calls,
                    tool_errors=self._counts[name].tool_errors,
                    failures=self._counts[name].failures,
                )
                for name, link in self.links.items()
            ),
        )
