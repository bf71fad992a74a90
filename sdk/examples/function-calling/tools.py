"""The tools the agent can call: their descriptions for the system prompt, and one call parsed
from the model's JSON, checked against the tool's parameters and run. Every mistake in a call
raises `ToolError`, whose message goes back to the model."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

CAPITALS = {
    "france": "Paris",
    "germany": "Berlin",
    "italy": "Rome",
    "japan": "Tokyo",
    "kenya": "Nairobi",
    "peru": "Lima",
}

JSON_TYPES: dict[str, tuple[type, ...]] = {"number": (int, float), "string": (str,)}


class ToolError(Exception):
    """A call the tools cannot run; the message says why, for the model to correct."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, str]
    """Each argument's name and JSON type ("number" or "string"); all are required."""
    run: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        properties = {name: {"type": kind} for name, kind in self.parameters.items()}
        return {
            "name": self.name,
            "description": self.description,
            "parameters": {"type": "object", "properties": properties},
        }


def toolbox(now: str | None) -> dict[str, Tool]:
    """The tools; `clock` answers `now` when given (for reproducible runs), else the real time."""

    def add(a: float, b: float) -> float:
        return a + b

    def clock() -> str:
        return now or datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

    def lookup(country: str) -> str:
        capital = CAPITALS.get(country.strip().lower())
        if capital is None:
            raise ToolError(f"no capital known for {country!r}; known: {', '.join(CAPITALS)}")
        return capital

    tools = [
        Tool("add", "Adds two numbers.", {"a": "number", "b": "number"}, add),
        Tool("clock", "The current date and time.", {}, clock),
        Tool("lookup", "The capital city of a country.", {"country": "string"}, lookup),
    ]
    return {tool.name: tool for tool in tools}


def parse_call(body: str, tools: dict[str, Tool]) -> tuple[Tool, dict[str, Any]]:
    """The tool and arguments named by a call's JSON body."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        raise ToolError(f"the tool call is not valid JSON ({err})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolError('a tool call is {"name": <tool name>, "arguments": {...}}')
    tool = tools.get(call["name"])
    if tool is None:
        raise ToolError(f"unknown tool {call['name']!r}; the tools are {', '.join(tools)}")
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolError("the arguments must be a JSON object")
    check_arguments(tool, arguments)
    return tool, arguments


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> None:
    missing = [name for name in tool.parameters if name not in arguments]
    unknown = [name for name in arguments if name not in tool.parameters]
    if missing or unknown:
        raise ToolError(
            f"{tool.name} takes {list(tool.parameters)}; missing {missing}, unknown {unknown}"
        )
    for name, kind in tool.parameters.items():
        value = arguments[name]
        if isinstance(value, bool) or not isinstance(value, JSON_TYPES[kind]):
            raise ToolError(f"{tool.name}: {name} must be a {kind}, not {json.dumps(value)}")
