"""Speculative decoding written as a program: a drafter proposes tokens, one pass verifies them
all, and the longest agreeing prefix is kept. The output equals plain generation token for
token; the pass count shows what the drafter saved."""

from __future__ import annotations

import time
from typing import Any

from inferlet import Context, Jacobi, PromptLookup, Sampler, get_model, speculate


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    method = input.get("method", "lookup")
    max_tokens = int(input.get("max_tokens", 128))
    temperature = float(input.get("temperature", 0.0))
    sampler = (
        Sampler.argmax()
        if temperature == 0
        else Sampler.multinomial(temperature=temperature, seed=input.get("seed"))
    )
    with Context(model) as ctx:
        if input.get("system"):
            ctx.system(input["system"])
        ctx.user(input["prompt"]).cue()
        started = time.monotonic()
        if method == "plain":
            generation = ctx.generate(sampler, max_tokens=max_tokens)
            await generation.collect_tokens()
            tokens, stop_reason = generation.tokens, generation.stop_reason
            # One pass per token, the stop token's included.
            passes, drafted, accepted = len(tokens) + (stop_reason == "stop_token"), 0, 0
        else:
            drafter = Jacobi() if method == "jacobi" else PromptLookup(int(input.get("ngram", 3)))
            result = await speculate(
                ctx,
                drafter,
                sampler=sampler,
                max_tokens=max_tokens,
                draft_tokens=int(input.get("draft_tokens", 4)),
            )
            tokens, passes = result.tokens, result.passes
            drafted, accepted, stop_reason = result.drafted, result.accepted, result.stop_reason
        seconds = time.monotonic() - started
        written = ctx.tokens
    return {
        "text": model.decode(tokens),
        "tokens": tokens,
        "stop_reason": stop_reason,
        "passes": passes,
        "drafted": drafted,
        "accepted": accepted,
        "seconds": seconds,
        "written": written,
    }
