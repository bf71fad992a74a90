"""Generates text carrying a green-list watermark (a logit bias on a pseudo-random half of the
vocabulary at every step, keyed by a secret and the token before), or detects one: the z-score
of green tokens in a text, computed from the text and the key alone."""

from __future__ import annotations

from typing import Any

from inferlet import Context, Sampler, Watermark, get_model


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    mark = Watermark(
        int(input.get("key", 42)),
        model.vocab_size,
        gamma=float(input.get("gamma", 0.5)),
        delta=float(input.get("delta", 4.0)),
    )
    if input.get("mode") == "detect":
        tokens = model.encode(input["text"])
        z = mark.z_score(tokens[1:], tokens[0]) if len(tokens) > 1 else 0.0
        return {"z": z, "tokens": len(tokens) - 1, "watermarked": z > float(input.get("z", 4.0))}
    sampler = Sampler.multinomial(
        temperature=float(input.get("temperature", 0.7)), seed=input.get("seed")
    )
    with Context(model) as ctx:
        ctx.user(input["prompt"]).cue()
        max_tokens = int(input.get("max_tokens", 96))
        if input.get("watermark", True):
            generation = mark.generate(ctx, sampler, max_tokens=max_tokens)
        else:
            generation = ctx.generate(sampler, max_tokens=max_tokens)
        text = await generation.collect_text()
    return {"text": text, "tokens": len(generation.tokens)}
