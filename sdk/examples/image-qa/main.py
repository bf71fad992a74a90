"""Answers a question about one picture: the picture and the question as a user message (after
an optional system message) in the model's chat template, then generation. The picture comes as
base64 bytes or from a URL; any model with a vision tower runs it unchanged."""

from __future__ import annotations

from typing import Any

from inferlet import Context
from inferlet.inputs import media_from, model_reading, sampler_from

KIND = "image"


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = model_reading(KIND, input.get("model") or "")
    with await media_from(input, KIND, model) as medium, Context(model) as ctx:
        if input.get("system"):
            ctx.system(input["system"])
        before = [input["before"]] if input.get("before") else []
        ctx.user([*before, medium, input.get("question", "What is in this picture?")]).cue()
        generation = ctx.generate(sampler_from(input), max_tokens=int(input.get("max_tokens", 128)))
        text = await generation.collect_text()
        return {
            "text": text,
            "tokens": generation.tokens,
            "media_tokens": medium.token_count(),
            "grid": list(medium.grid()),
        }
