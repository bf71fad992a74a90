"""Tools on MCP (Model Context Protocol) servers. The operator lists the servers in the engine's
`[mcp]` config; the engine starts them, talks to them and hands the results back.

    for tool in await mcp.tools("files"):
        print(tool.name, tool.description, tool.input_schema)
    result = await mcp.call("files", "read_file", {"path": "notes.txt"})
    print(result.text)

Failures raise `HostError`: `no-such-server`, `denied` (this user may not use that server),
`no-such-tool`, `invalid` (arguments that are not a JSON object), `timeout`, `unavailable` (the
server could not be started or its connection broke), `tool-failed` (the server answered with
an error) and `too-large`. A tool that ran and reported a failure is not an exception: its
result has `is_error` set (`raise_for_error()` turns it into one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from wit_world.imports import mcp as _mcp

from inferlet import _loop
from inferlet.errors import HostError
from inferlet.errors import call as host_call


class Tool:
    def __init__(self, server: str, raw: Any) -> None:
        self.server = server
        self.name: str = raw.name
        self.description: str = raw.description
        self.input_schema: dict[str, Any] = json.loads(raw.input_schema)
        """The JSON Schema of the tool's arguments."""

    def definition(self) -> dict[str, Any]:
        """The tool as function-calling prompts describe one: name, description, parameters."""
        return {"name": self.name, "description": self.description, "parameters": self.input_schema}

    async def __call__(
        self, arguments: Mapping[str, Any] | None = None, **options: Any
    ) -> ToolResult:
        """Calls this tool (see `call`)."""
        return await call(self.server, self.name, arguments, **options)

    def __repr__(self) -> str:
        return f"Tool({self.server!r}, {self.name!r})"


class ToolResult:
    def __init__(self, raw: Any) -> None:
        self.content: list[dict[str, Any]] = json.loads(raw.content)
        """Content blocks in MCP's shape: {"type": "text", "text": ...}, image, audio,
        resource_link, resource."""
        self.text: str = raw.text
        """The content as text: text blocks joined by newlines, other blocks named in brackets."""
        self.structured: Any = None if raw.structured is None else json.loads(raw.structured)
        """The tool's structured result, when it gave one."""
        self.is_error: bool = raw.is_error

    def raise_for_error(self) -> ToolResult:
        if self.is_error:
            raise HostError("tool-error", self.text)
        return self

    def __repr__(self) -> str:
        return f"ToolResult({self.text!r}, is_error={self.is_error})"


def servers() -> list[str]:
    """The MCP servers this inferlet may use, by name."""
    return list(_mcp.servers())


async def tools(server: str) -> list[Tool]:
    """Every tool `server` offers."""
    pending = host_call(_mcp.list_tools, server)
    await _loop.ready(pending)
    return [Tool(server, raw) for raw in host_call(_mcp.tools, pending)]


async def call(
    server: str,
    name: str,
    arguments: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
) -> ToolResult:
    """Calls tool `name` on `server` and waits for its result (other inferlets' passes go on
    meanwhile). `timeout` is in seconds; the engine's `mcp.timeout_seconds` is the most."""
    text = json.dumps(dict(arguments or {}))
    timeout_ms = None if timeout is None else max(1, int(timeout * 1000))
    pending = host_call(_mcp.call_tool, server, name, text, timeout_ms)
    await _loop.ready(pending)
    return ToolResult(host_call(_mcp.called, pending))
