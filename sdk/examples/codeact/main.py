"""CodeACT agent: the model acts by writing a fenced Python block; the inferlet runs it in its own
sandboxed interpreter and appends the output to the same context as an observation turn, so each
step prefills only the new tokens, until the model answers without code or the steps run out."""

from __future__ import annotations

import re
from typing import Any

from executor import Execution, Executor
from inferlet import Context, get_model
from inferlet.turns import take_turn

SYSTEM = (
    "You solve tasks by running Python. To run code, reply with one block\n"
    "```python\n<code>\n```\n"
    "and stop there: the user replies with what the code printed. Use print() to see values. "
    "When you know the answer, reply with the answer alone, without code."
)
# The opening fence names the language, so only a closing fence is followed by a newline.
CLOSING_FENCE = "```\n"
CODE_BLOCK = re.compile(r"```py(?:thon)?\n(.*?)```", re.DOTALL)


async def main(input: dict[str, Any]) -> dict[str, Any]:
    max_steps = int(input.get("max_steps", 4))
    max_tokens = int(input.get("max_tokens", 128))
    executor = Executor(int(input.get("max_output_chars", 2000)))
    steps: list[dict[str, Any]] = []
    final = None
    with Context(get_model()) as ctx:
        ctx.system(input.get("system", SYSTEM)).user(input["task"]).cue()
        for number in range(1, max_steps + 1):
            prefill = input.get("prefill", "") if number == 1 else ""
            turn = await take_turn(
                ctx,
                stop=CLOSING_FENCE,
                max_tokens=max_tokens,
                prefill=prefill,
                prefill_acts=find_code(prefill) is not None,
                check_fresh=bool(input.get("check_fresh")),
            )
            step = turn.report()
            steps.append(step)
            code = find_code(turn.text)
            if code is None:
                final = turn.text.strip()
                break
            execution = executor.run(code, f"<step {number}>")
            step.update(code=code, output=execution.output, failed=execution.failed)
            if number < max_steps:
                step["appended"] = observe(ctx, execution)
        return {"steps": steps, "final": final, "context_tokens": ctx.info().tokens}


def find_code(text: str) -> str | None:
    """The code of the first complete ```python block in `text`."""
    block = CODE_BLOCK.search(text)
    return None if block is None else block.group(1)


def observe(ctx: Context, execution: Execution) -> str:
    """Queues the execution's output as a user turn and the next cue; returns the text queued,
    which the next step's first pass feeds on top of the cached context."""
    before = ctx.chat.rendered
    heading = "The code failed:" if execution.failed else "Output:"
    ctx.user(f"{heading}\n{execution.output.rstrip() or '(nothing printed)'}").cue()
    return ctx.chat.rendered[len(before) :]
