"""Runs the MCP steps it is given ({"steps": [...]}) in order and returns what each gave:
{"op": "servers"}, {"op": "tools", "server"}, {"op": "call", "server", "tool", "arguments",
"timeout"}, {"op": "raw", "server", "tool", "text"} (arguments as text, sent as is), and
{"op": "race", "calls": [call steps]} (concurrently; results in the order they finished).
A failure gives {"error": kind, "message": ...}."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import HostError, _loop, mcp
from inferlet.errors import call as host_call
from wit_world.imports import mcp as raw_mcp


def _result(result: mcp.ToolResult) -> dict[str, Any]:
    return {
        "text": result.text,
        "content": result.content,
        "structured": result.structured,
        "is_error": result.is_error,
    }


async def _raw(step: dict[str, Any]) -> dict[str, Any]:
    pending = host_call(raw_mcp.call_tool, step["server"], step["tool"], step["text"], None)
    await _loop.ready(pending)
    return _result(mcp.ToolResult(host_call(raw_mcp.called, pending)))


async def _step(step: dict[str, Any]) -> Any:
    op = step["op"]
    if op == "servers":
        return mcp.servers()
    if op == "tools":
        tools = await mcp.tools(step["server"])
        return [
            {"name": t.name, "description": t.description, "schema": t.input_schema} for t in tools
        ]
    if op == "call":
        result = await mcp.call(
            step["server"], step["tool"], step.get("arguments"), timeout=step.get("timeout")
        )
        return _result(result)
    if op == "raw":
        return await _raw(step)
    if op == "race":
        finished: list[Any] = []

        async def one(call: dict[str, Any]) -> None:
            finished.append({"tool": call["tool"], "result": await _guarded(call)})

        await asyncio.gather(*(one(call) for call in step["calls"]))
        return finished
    raise ValueError(f"unknown op {op!r}")


async def _guarded(step: dict[str, Any]) -> Any:
    try:
        return await _step(step)
    except HostError as err:
        return {"error": err.kind, "message": err.message}


async def main(input: dict[str, Any]) -> list[Any]:
    return [await _guarded(step) for step in input["steps"]]
