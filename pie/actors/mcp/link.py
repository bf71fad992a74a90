"""One configured MCP server as the mcp actor sees it: a client session opened on first use and
held open by a task of its own, reopened on the next use after it breaks. A server that fails to
start is not tried again for `retry_seconds`; meanwhile its requests fail `unavailable` at once."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx2
import mcp_types
import trio
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from pydantic import ValidationError

from pie import __version__
from pie.actors.mcp.results import McpFailure
from pie.config import McpServerConfig

T = TypeVar("T")

MAX_LISTING_PAGES = 100
"""A server whose tool listing never ends is read this far."""


def describe(exc: BaseException) -> str:
    """What went wrong, from the innermost exceptions of a group (anyio wraps them)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    if isinstance(exc, MCPError):
        return exc.message
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _address(url: str) -> str:
    """A URL without its user info, query and fragment, where a credential may hide."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


class ServerLink:
    def __init__(
        self, config: McpServerConfig, *, connect_seconds: float, retry_seconds: float
    ) -> None:
        self.config = config
        self.name = config.name
        self._connect_seconds = connect_seconds
        self._retry_seconds = retry_seconds
        self._client: Client | None = None
        self._closing = trio.Event()
        self._opening: trio.Event | None = None
        self._failure = ""
        self._retry_at = -math.inf
        self._tool_names: set[str] = set()
        self.starts = 0
        self.start_failures = 0

    @property
    def connected(self) -> bool:
        return self._client is not None

    def allows(self, user: str) -> bool:
        return not self.config.users or user in self.config.users

    async def tools(self, nursery: trio.Nursery) -> list[mcp_types.Tool]:
        """Every tool the server lists, page after page."""
        return await self._run(nursery, self._list)

    async def has_tool(self, nursery: trio.Nursery, name: str) -> bool:
        """Whether the server has the tool; an unknown name re-reads the listing first, since
        servers may add tools as they go."""
        if name not in self._tool_names:
            await self.tools(nursery)
        return name in self._tool_names

    async def call(
        self, nursery: trio.Nursery, name: str, arguments: dict[str, Any]
    ) -> mcp_types.CallToolResult:
        return await self._run(nursery, lambda client: client.call_tool(name, arguments))

    def close(self) -> None:
        """Ends the session (its task closes it: the server process is stopped)."""
        self._client = None
        self._closing.set()

    async def _list(self, client: Client) -> list[mcp_types.Tool]:
        listed: list[mcp_types.Tool] = []
        cursor: str | None = None
        for _ in range(MAX_LISTING_PAGES):
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        self._tool_names = {tool.name for tool in listed}
        return listed

    async def _run(self, nursery: trio.Nursery, operation: Callable[[Client], Awaitable[T]]) -> T:
        client = await self._session(nursery)
        try:
            return await operation(client)
        except MCPError as exc:
            if exc.code != mcp_types.CONNECTION_CLOSED:
                raise McpFailure("tool-failed", f"{self.name!r} answered: {exc.message}") from None
            reason = exc.message
        except ValidationError as exc:
            raise McpFailure(
                "tool-failed", f"{self.name!r} sent a malformed answer: {exc}"
            ) from None
        except Exception as exc:
            reason = describe(exc)
        if self._client is client:
            self.close()
        raise McpFailure("unavailable", f"the connection to {self.name!r} broke: {reason}")

    async def _session(self, nursery: trio.Nursery) -> Client:
        """The open session; the first caller starts it and every caller waits for it."""
        if self._client is not None:
            return self._client
        wait = self._retry_at - trio.current_time()
        if wait > 0:
            raise McpFailure("unavailable", f"{self._failure} (next try in {wait:.1f} s)")
        if self._opening is None:
            self._opening = trio.Event()
            nursery.start_soon(self._keep, self._opening)
        await self._opening.wait()
        if self._client is None:
            raise McpFailure("unavailable", self._failure)
        return self._client

    async def _keep(self, opened: trio.Event) -> None:
        """Opens the session and holds it until it is closed; cancelled, the transport still
        stops the server (the mcp package shields and bounds that)."""
        closing = trio.Event()
        started = False
        try:
            with trio.move_on_after(self._connect_seconds) as connecting:
                async with self._connect() as client:
                    connecting.deadline = math.inf
                    started = True
                    self._up(client, closing, opened)
                    await closing.wait()
            if not started:
                self._start_failed(f"no answer within {self._connect_seconds:g} s")
        except Exception as exc:
            if not started:
                self._start_failed(describe(exc))
        finally:
            if self._closing is closing:
                self._client = None
            if self._opening is opened:
                self._opening = None
            opened.set()

    def _up(self, client: Client, closing: trio.Event, opened: trio.Event) -> None:
        self._client, self._closing = client, closing
        self._tool_names = set()
        self.starts += 1
        self._opening = None
        opened.set()

    def _start_failed(self, reason: str) -> None:
        self.start_failures += 1
        if self.config.command:
            what = f"({self.config.command[0]}) did not start"
        else:
            what = f"({_address(self.config.url)}) was not reached"
        self._failure = f"mcp server {self.name!r} {what}: {reason}"
        self._retry_at = trio.current_time() + self._retry_seconds

    @contextlib.asynccontextmanager
    async def _connect(self) -> AsyncIterator[Client]:
        config = self.config
        info = mcp_types.Implementation(name="pie", version=__version__)
        if config.command:
            params = StdioServerParameters(
                command=config.command[0],
                args=list(config.command[1:]),
                env=config.env or None,
                cwd=config.cwd or None,
            )
            async with Client(params, client_info=info) as client:
                yield client
            return
        timeout = httpx2.Timeout(30.0, read=300.0)
        async with httpx2.AsyncClient(headers=config.headers, timeout=timeout) as http:
            transport = streamable_http_client(config.url, http_client=http)
            async with Client(transport, client_info=info) as client:
                yield client
