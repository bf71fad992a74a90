"""Beam search with the distribution probe: `width` beams, each step one pass per beam (all
batched), a chosen continuation forking its parent. Width 1 is greedy decoding."""

from __future__ import annotations

from typing import Any

from inferlet import Context, beam_search, get_model


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    ctx = Context(model)
    ctx.user(input["prompt"]).cue()
    beams = await beam_search(
        ctx,
        int(input.get("width", 3)),
        max_tokens=int(input.get("max_tokens", 32)),
        length_penalty=float(input.get("length_penalty", 1.0)),
    )
    return {
        "beams": [
            {"text": b.text, "tokens": b.tokens, "logprob": b.logprob, "finished": b.finished}
            for b in beams
        ]
    }
