"""A chat over session messages: one context holds the whole conversation, so each turn feeds
the model only its own new tokens. "/bye" ends it; the result is the number of turns."""

from __future__ import annotations

import json
from typing import Any

from inferlet import Context, Sampler, get_model, session

BYE = "/bye"


async def main(input: dict[str, Any] | str) -> int:
    options = input if isinstance(input, dict) else {}
    max_tokens = int(options.get("max_tokens", 24))
    turns = 0
    with Context(get_model()) as ctx:
        if options.get("system"):
            ctx.system(options["system"])
        while (message := await session.receive()) != BYE:
            text = message if isinstance(message, str) else message.decode()
            session.send(json.dumps(await reply(ctx, text, max_tokens)))
            turns += 1
    return turns


async def reply(ctx: Context, text: str, max_tokens: int) -> dict[str, Any]:
    """One turn: the user message and the assistant cue, then a greedy reply. The context keeps
    the reply, so the next turn starts where this one ended."""
    ctx.user(text).cue()
    generation = ctx.generate(Sampler.argmax(), max_tokens=max_tokens)
    answer = await generation.collect_text()
    return {
        "reply": answer,
        # The first pass of a generation feeds everything queued since the last pass.
        "prefilled": generation.prompt_tokens,
        "context_tokens": ctx.info().tokens,
        "finish": generation.stop_reason,
    }
