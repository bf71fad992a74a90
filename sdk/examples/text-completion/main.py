"""Completes one prompt: a user message (after an optional system message) in the model's chat
template, then generation until a stop token or `max_tokens`, optionally streamed to the client.
`model` names one of the engine's models (default: its first)."""

from __future__ import annotations

from typing import Any

from inferlet import Context, get_model, session
from inferlet.inputs import sampler_from


async def main(input: dict[str, Any] | str) -> str:
    request = {"prompt": input} if isinstance(input, str) else input
    model = get_model(request.get("model") or "")
    with Context(model) as ctx:
        if request.get("system"):
            ctx.system(request["system"])
        ctx.user(request["prompt"]).cue()
        generation = ctx.generate(
            sampler_from(request), max_tokens=int(request.get("max_tokens", 128))
        )
        if not request.get("stream"):
            return await generation.collect_text()
        # Pieces are whole characters (the SDK holds back split UTF-8), so each can go as text.
        async for piece in generation:
            session.send(piece)
        return generation.text
