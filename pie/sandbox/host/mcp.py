"""The `mcp` interface: tools on the operator's MCP servers, listed and called by the mcp actor."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance

from pie.events import mcp as ev
from pie.sandbox.host.state import current, host_call
from pie.sandbox.wasm import add_host_func, record

INTERFACE = "pie:inferlet/mcp@0.1.0"


def servers() -> list[str]:
    state = current()
    event = ev.McpListServers(corr=state.next_corr(), requester=state.address, user=state.user)
    answer: ev.McpServerList = state.request("mcp", event)
    return list(answer.servers)


def list_tools(server: str) -> int:
    state = current()
    event = ev.McpListTools(
        corr=state.next_corr(), requester=state.address, user=state.user, server=server
    )
    handle = state.new_handle()
    if state.trace is not None:
        # Before the request leaves: the mcp actor's span goes under this one.
        state.trace.opened(handle, "pie.mcp.list_tools", event.corr, {"pie.mcp.server": server})
    return state.submit("mcp", event, "mcp-tools", handle)


def tools(pending: int) -> list[Any]:
    listing: ev.McpToolList = current().take(pending, "mcp-tools")
    return [
        record(name=t.name, description=t.description, input_schema=t.input_schema)
        for t in listing.tools
    ]


def call_tool(server: str, name: str, arguments: str, timeout_ms: int | None) -> int:
    state = current()
    event = ev.McpCallTool(
        corr=state.next_corr(),
        requester=state.address,
        user=state.user,
        server=server,
        tool=name,
        arguments=arguments,
        timeout_seconds=None if timeout_ms is None else timeout_ms / 1000,
    )
    handle = state.new_handle()
    if state.trace is not None:
        called = {"pie.mcp.server": server, "pie.mcp.tool": name}
        state.trace.opened(handle, "pie.mcp.call_tool", event.corr, called)
    return state.submit("mcp", event, "mcp-call", handle)


def called(pending: int) -> Any:
    result: ev.McpToolCalled = current().take(pending, "mcp-call")
    return record(
        content=result.content,
        text=result.text,
        structured=result.structured,
        is_error=result.is_error,
    )


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "servers", servers)
    add_host_func(instance, "list-tools", host_call(list_tools))
    add_host_func(instance, "tools", host_call(tools))
    add_host_func(instance, "call-tool", host_call(call_tool))
    add_host_func(instance, "called", host_call(called))
