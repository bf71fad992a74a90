"""Completes one prompt: a user message (after an optional system message) in the model's chat
template, then generation until a stop token or `max_tokens`, optionally streamed to the client.
`model` names one of the engine's models (default: its first)."""

from __future__ import annotations

from typing import Any

from inferlet import Context, Sampler, get_model, session


async def main(input: dict[str, Any] | str) -> str:
    request = {"prompt": input} if isinstance(input, str) else input
    model = get_model(request.get("model") or "")
    with Context(model) as ctx:
        if request.get("system"):
            ctx.system(request["system"])
        ctx.user(request["prompt"]).cue()
        generation = ctx.generate(
            choose_sampler(request), max_tokens=int(request.get("max_tokens", 128))
        )
        if not request.get("stream"):
            return await generation.collect_text()
        # Pieces are whole characters (the SDK holds back split UTF-8), so each can go as text.
        async for piece in generation:
            session.send(piece)
        return generation.text


def choose_sampler(request: dict[str, Any]) -> Sampler:
    """Temperature 0 (the default) is greedy; otherwise nucleus when top_p < 1 is given, else
    multinomial; `seed` makes either reproducible."""
    temperature = float(request.get("temperature", 0.0))
    seed = request.get("seed")
    if temperature == 0:
        return Sampler.argmax()
    top_p = request.get("top_p")
    if top_p is not None and float(top_p) < 1.0:
        return Sampler.top_p(float(top_p), temperature=temperature, seed=seed)
    return Sampler.multinomial(temperature=temperature, seed=seed)
