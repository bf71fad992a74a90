"""Function calling: the system prompt describes the tools and a JSON call format; generation
stops at a complete call, the inferlet runs the tool and appends its result as a tool turn to the
same context, so generation goes on without prefilling earlier tokens again, until an answer."""

from __future__ import annotations

import json
from typing import Any

from inferlet import Context, get_model
from inferlet.turns import take_turn
from tools import Tool, ToolError, parse_call, toolbox

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def system_prompt(tools: dict[str, Tool]) -> str:
    schemas = "\n".join(json.dumps(tool.schema()) for tool in tools.values())
    return (
        f"You can call these tools:\n<tools>\n{schemas}\n</tools>\n"
        f'To call one, reply with {OPEN}{{"name": <tool name>, "arguments": <JSON object>}}{CLOSE} '
        "and stop there: the result comes back in <tool_response></tool_response>. "
        "When you know the answer, reply with the answer alone."
    )


async def main(input: dict[str, Any]) -> dict[str, Any]:
    tools = toolbox(input.get("now"))
    max_steps = int(input.get("max_steps", 4))
    steps: list[dict[str, Any]] = []
    final = None
    with Context(get_model()) as ctx:
        ctx.system(system_prompt(tools)).user(input["task"]).cue()
        for number in range(1, max_steps + 1):
            prefill = input.get("prefill", "") if number == 1 else ""
            turn = await take_turn(
                ctx,
                stop=CLOSE,
                max_tokens=int(input.get("max_tokens", 128)),
                prefill=prefill,
                prefill_acts=CLOSE in prefill,
                check_fresh=bool(input.get("check_fresh")),
            )
            step = turn.report()
            steps.append(step)
            if OPEN not in turn.text:
                final = turn.text.strip()
                break
            step.update(call_tool(turn.text, tools))
            if number < max_steps:
                step["appended"] = respond(ctx, step)
        return {"steps": steps, "final": final, "context_tokens": ctx.info().tokens}


def call_tool(text: str, tools: dict[str, Tool]) -> dict[str, Any]:
    """Runs the first call in `text`: its name, arguments and result, or the error that stopped
    it (bad JSON, an unknown tool, wrong arguments, a call never closed, a failing tool)."""
    body, closed, _ = text.split(OPEN, 1)[1].partition(CLOSE)
    call = None
    try:
        if not closed:
            raise ToolError(f"the tool call was not closed with {CLOSE}")
        tool, arguments = parse_call(body, tools)
        call = {"name": tool.name, "arguments": arguments}
        return {"call": call, "result": tool.run(**arguments), "error": None}
    except ToolError as err:
        return {"call": call, "result": None, "error": str(err)}


def respond(ctx: Context, step: dict[str, Any]) -> str:
    """Queues the call's outcome as a tool turn and the next cue; returns the text queued, which
    the next step's first pass feeds on top of the cached context."""
    outcome = {"name": step["call"]["name"]} if step["call"] else {}
    if step["error"] is None:
        outcome["content"] = step["result"]
    else:
        outcome["error"] = step["error"]
    before = ctx.chat.rendered
    ctx.fill(ctx.chat.add("tool", f"<tool_response>\n{json.dumps(outcome)}\n</tool_response>"))
    ctx.cue()
    return ctx.chat.rendered[len(before) :]
