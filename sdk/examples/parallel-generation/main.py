"""Prefills a prompt once, forks it into n branches and generates them concurrently: the
branches share the prompt's KV pages and their passes are batched together."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import Context, Sampler, get_model


async def main(input: dict[str, Any]) -> list[str]:
    n = int(input.get("n", 4))
    max_tokens = int(input.get("max_tokens", 64))
    temperature = float(input.get("temperature", 0.8))
    seed = input.get("seed")
    model = get_model()
    prompt = Context(model)
    prompt.user(input["prompt"]).cue()
    await prompt.flush()
    branches = [prompt.fork() for _ in range(n)]

    def sampler(i: int) -> Sampler:
        if temperature == 0:
            return Sampler.argmax()
        # A distinct seed per branch, so seeded branches differ but repeat run to run.
        return Sampler.multinomial(temperature=temperature, seed=None if seed is None else seed + i)

    return await asyncio.gather(
        *(
            b.generate(sampler(i), max_tokens=max_tokens).collect_text()
            for i, b in enumerate(branches)
        )
    )
