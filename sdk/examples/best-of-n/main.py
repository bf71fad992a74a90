"""Best-of-n: the prompt is prefilled once, n branches forked off it (sharing its KV pages)
generate at once, and each is scored by the mean log-probability of its tokens in one pass.
With `separate`, each of the n prompts is a context of its own, prefilled on its own (the
comparison `pie bench decoding` makes); the ranking is the same."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import Candidate, Context, Sampler, best_of_n, get_model, token_logprobs


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    n = int(input.get("n", 4))
    max_tokens = int(input.get("max_tokens", 48))
    sampler = Sampler.multinomial(
        temperature=float(input.get("temperature", 0.8)), seed=input.get("seed")
    )
    if input.get("separate"):
        ranked = await _separate(model, input["prompt"], n, sampler, max_tokens)
    else:
        prompt = Context(model)
        prompt.user(input["prompt"]).cue()
        ranked = await best_of_n(prompt, n, sampler, max_tokens=max_tokens)
    return {
        "best": ranked[0].text,
        "candidates": [
            {"index": c.index, "text": c.text, "mean_logprob": c.mean_logprob} for c in ranked
        ],
    }


async def _separate(
    model: Any, prompt: str, n: int, sampler: Sampler, max_tokens: int
) -> list[Candidate]:
    contexts = [Context(model).user(prompt).cue() for _ in range(n)]
    await asyncio.gather(*(ctx.flush() for ctx in contexts))
    prefixes = [ctx.fork() for ctx in contexts]
    seeds = [None if sampler.seed is None else sampler.seed + i for i in range(n)]
    gens = [
        ctx.generate(Sampler(sampler.kind, sampler.temperature, seed=seed), max_tokens=max_tokens)
        for ctx, seed in zip(contexts, seeds, strict=True)
    ]
    await asyncio.gather(*(g.collect_tokens() for g in gens))
    scores = await asyncio.gather(
        *(token_logprobs(p, g.tokens) for p, g in zip(prefixes, gens, strict=True))
    )
    candidates = [
        Candidate(g.tokens, g.text, g.stop_reason or "", sum(s) / max(1, len(s)), i)
        for i, (g, s) in enumerate(zip(gens, scores, strict=True))
    ]
    return sorted(candidates, key=lambda c: (-c.mean_logprob, c.index))
