"""Tool calling for Chat Completions, Hermes style: the tools are listed in a system-prompt
section, a call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and a grammar holds
every call's arguments to its tool's parameter schema. Messages that carry calls and their
results are rendered back into that same form."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inferlet import Grammar, HostError
from inferlet.serving import HttpError
from params import message, text_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""The spacing the grammar engine gives schema output, so a call reads as `json.dumps` writes."""
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def listing(self) -> str:
        function = {"name": self.name, "description": self.description}
        return json.dumps(
            {"type": "function", "function": {**function, "parameters": self.parameters}}
        )


@dataclass(frozen=True)
class ToolUse:
    """The request's tools and how the model may use them: `choice` is none, auto, required or
    the one tool's name that it must call."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool

    @property
    def offered(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.offered and self.choice != "auto"

    @property
    def several(self) -> bool:
        """Whether a reply may hold more than one call (never for a named tool)."""
        return self.parallel and self.choice in ("auto", "required")


def tool_use(body: dict[str, Any]) -> ToolUse:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked."""
    given = body.get("tools") or []
    if not isinstance(given, list):
        raise HttpError(400, "tools: a list of function tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(given))
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise HttpError(400, "tools: two tools share a name")
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise HttpError(400, "parallel_tool_calls: true or false")
    return ToolUse(tools, _choice(body.get("tool_choice"), names), parallel is not False)


def _tool(tool: Any, where: str) -> Tool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise HttpError(400, f"{where}.type: only function tools are supported")
    _known(tool, {"type", "function"}, where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise HttpError(400, f"{where}.function: an object with a name and parameters")
    where += ".function"
    _known(function, {"name", "description", "parameters", "strict"}, where)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise HttpError(400, f"{where}.name: 1 to 64 letters, digits, _ or -")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise HttpError(400, f"{where}.description: a string")
    if function.get("strict") not in (None, True, False):
        raise HttpError(400, f"{where}.strict: true or false")
    # No parameters means a function that takes none.
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    parameters = function.get("parameters", empty)
    if not isinstance(parameters, dict):
        raise HttpError(400, f"{where}.parameters: a JSON Schema object")
    return Tool(name, description, parameters)


def _known(given: dict[str, Any], known: set[str], where: str) -> None:
    for field in given:
        if field not in known:
            raise HttpError(400, f"{where}.{field}: not supported by this server")


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise HttpError(400, "tool_choice: none, auto, required or a named function")
        if choice == "required" and not names:
            raise HttpError(400, "tool_choice: `required` needs tools")
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type") != "function":
        raise HttpError(400, "tool_choice: none, auto, required or a named function")
    name = function.get("name")
    if name not in names:
        raise HttpError(400, f"tool_choice.function.name: no tool is named {name!r}")
    return str(name)


def with_tools(messages: list[dict[str, Any]], use: ToolUse) -> list[dict[str, Any]]:
    """The conversation with the tools described in its system message (added when missing)."""
    if not use.offered:
        return messages
    listing = "\n".join(t.listing() for t in use.tools)
    how = "one or more calls" if use.several else "one call"
    section = (
        "# Tools\n\nYou may call functions to help answer. They are listed, one JSON object per"
        f" line, inside <tools></tools>:\n<tools>\n{listing}\n</tools>\n\nTo call functions,"
        f" answer with {how}, each a JSON object with the function's name and arguments inside"
        f' {OPEN}{CLOSE}:\n{OPEN}{{"name": <function name>, "arguments": <arguments object>}}'
        f"{CLOSE}"
    )
    if messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{section}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def conversation(messages: Any) -> list[dict[str, Any]]:
    """Chat Completions messages as chat-template messages: an assistant's calls in the form the
    model writes them, and each run of `tool` results as one user turn of <tool_response> blocks,
    in order (as Qwen's template renders them)."""
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages: a non-empty list of messages")
    rendered: list[dict[str, Any]] = []
    calls: set[str] = set()
    results: list[str] = []
    for i, given in enumerate(messages):
        where = f"messages[{i}]"
        role = given.get("role") if isinstance(given, dict) else None
        if role == "tool":
            results.append(_result(given, where, calls))
            continue
        if results:
            rendered.append({"role": "user", "content": "\n".join(results)})
            results = []
        if role == "assistant" and given.get("tool_calls"):
            rendered.append(_assistant_calls(given, where, calls))
        else:
            rendered.append(message(given, where))
    if results:
        rendered.append({"role": "user", "content": "\n".join(results)})
    return rendered


def _result(given: dict[str, Any], where: str, calls: set[str]) -> str:
    ident = given.get("tool_call_id")
    if not isinstance(ident, str):
        raise HttpError(400, f"{where}.tool_call_id: the id of the call this answers")
    if ident not in calls:
        raise HttpError(400, f"{where}.tool_call_id: no earlier assistant call has id {ident!r}")
    return f"<tool_response>\n{text_of(given.get('content'), f'{where}.content')}\n</tool_response>"


def _assistant_calls(given: dict[str, Any], where: str, calls: set[str]) -> dict[str, str]:
    content = given.get("content")
    text = "" if content is None else text_of(content, f"{where}.content")
    listed = given["tool_calls"]
    if not isinstance(listed, list):
        raise HttpError(400, f"{where}.tool_calls: a list of function calls")
    written = [_call_text(c, f"{where}.tool_calls[{j}]", calls) for j, c in enumerate(listed)]
    return {"role": "assistant", "content": "\n".join([text, *written] if text else written)}


def _call_text(call: Any, where: str, calls: set[str]) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(call.get("id"), str):
        raise HttpError(400, f"{where}: an object with an id and a function")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise HttpError(400, f"{where}.function: a name and arguments as JSON text")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        raise HttpError(400, f"{where}.function.arguments: not JSON text") from None
    calls.add(call["id"])
    return f"{OPEN}{json.dumps({'name': name, 'arguments': parsed})}{CLOSE}"


def grammar_source(use: ToolUse, answer: dict[str, Any] | None) -> str:
    """Lark for the reply: forced, the calls alone; in `auto`, either the calls or an answer
    (free text that does not start like a call, or JSON for `answer` when the request sets a
    response_format). Calls follow one another on new lines when parallel calls are allowed."""
    tools = [t for t in use.tools if use.choice in ("auto", "required", t.name)]
    rules = [
        "calls: call (/\\n/ call)*" if use.several else "calls: call",
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        head = json.dumps(f'{OPEN}{{"name": {json.dumps(tool.name)}, "arguments": ')
        rules.append(f'call_{i}: {head} args_{i} "}}{CLOSE}"')
        rules.append(f"args_{i}: %json {json.dumps(_styled(tool.parameters))}")
    if use.forced:
        return "\n".join(["start: calls", *rules])
    if answer is not None:
        return "\n".join(
            ["start: answer | calls", f"answer: %json {json.dumps(_styled(answer))}", *rules]
        )
    # Calls open the reply: after leading spaces a call would race the text lexeme, which the
    # lexer cannot take back. So text may not start like a call, even after spaces.
    text = f"TEXT: /(?s:.+)/ & ~/(?s:\\s*{OPEN}.*)/"
    return "\n".join(["start: TEXT | calls", text, *rules])


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with the engine's JSON spacing, unless it sets its own."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_STYLE, **(own if isinstance(own, dict) else {})}}


def compile_grammar(model: Any, use: ToolUse, answer: dict[str, Any] | None) -> Grammar:
    """The reply's grammar, compiled once for all choices; a tool whose parameters the grammar
    engine refuses is named in the 400."""
    try:
        return Grammar.lark(model, grammar_source(use, answer))
    except HostError as error:
        if error.kind != "invalid":
            raise
        for i, tool in enumerate(use.tools):
            try:
                Grammar.json_schema(model, tool.parameters).free()
            except HostError as refused:
                raise HttpError(400, f"tools[{i}].function.parameters: {refused.message}") from None
        field = "tools" if answer is None else "response_format"
        raise HttpError(400, f"{field}: {error.message}") from None


def split(text: str, ident: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A reply's content and tool calls: a reply of calls has no content; a call cut short by
    max_tokens is left out, and a reply with no whole call is content."""
    if not text.startswith(OPEN):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while text.startswith(OPEN, at):
        try:
            call, end = decoder.raw_decode(text, at + len(OPEN))
        except ValueError:
            break
        if not text.startswith(CLOSE, end):
            break
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        function = {"name": call["name"], "arguments": arguments}
        calls.append({"id": f"{ident}_{len(calls)}", "type": "function", "function": function})
        at = end + len(CLOSE) + 1
    return (None if calls else text), calls


class CallStream:
    """A streamed reply as content deltas and, at its end, tool calls. With tools in `auto`,
    text is held back while it could still be the start of a call."""

    def __init__(self, use: ToolUse) -> None:
        self.mode = "calls" if use.forced else "auto" if use.offered else "text"
        self.held = ""

    def piece(self, text: str) -> str:
        """The content to send now for a streamed piece."""
        if self.mode == "text":
            return text
        self.held += text
        start = self.held.lstrip()
        if self.mode == "auto" and not (start.startswith(OPEN) or OPEN.startswith(start)):
            self.mode, text, self.held = "text", self.held, ""
            return text
        return ""

    def finish(self, text: str, ident: str) -> tuple[str, list[dict[str, Any]]]:
        """The content still held and the calls, once the whole reply is `text`."""
        if self.mode == "text":
            return self.held, []
        content, calls = split(text, ident)
        return content or "", calls
