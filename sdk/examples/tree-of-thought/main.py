"""Tree-of-thought: at each level every kept node forks `breadth` children that each write one
more step of reasoning; the children are scored by the mean log-probability of their step and
the best `keep` go on. The best leaf then writes the answer."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import Context, Sampler, get_model, token_logprobs


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    breadth, keep = int(input.get("breadth", 3)), int(input.get("keep", 2))
    seed = int(input.get("seed", 0))
    root = Context(model)
    root.user(f"{input['problem']}\nThink step by step, one short step per line.").cue()
    await root.flush()
    frontier: list[tuple[float, Context, list[str]]] = [(0.0, root, [])]
    for level in range(int(input.get("depth", 2))):
        children = []
        for n, (_, parent, steps) in enumerate(frontier):
            for b in range(breadth):
                children.append(
                    (
                        parent,
                        steps,
                        Sampler.multinomial(temperature=0.9, seed=seed + 100 * level + 10 * n + b),
                    )
                )
        scored = await asyncio.gather(*(_expand(parent, steps, s) for parent, steps, s in children))
        scored.sort(key=lambda node: -node[0])
        for _, ctx, _ in scored[keep:]:
            ctx.destroy()
        frontier = scored[:keep]
    score, best, steps = frontier[0]
    answer = (
        await best.fill("\nAnswer:")
        .generate(max_tokens=int(input.get("answer_tokens", 32)))
        .collect_text()
    )
    return {"steps": steps, "score": score, "answer": answer.strip()}


async def _expand(
    parent: Context, steps: list[str], sampler: Sampler
) -> tuple[float, Context, list[str]]:
    child = parent.fork()
    prefix = child.fork()
    gen = child.generate(sampler, max_tokens=40, stop_strings=["\n"])
    await gen.collect_tokens()
    logprobs = await token_logprobs(prefix, gen.tokens)
    prefix.destroy()
    child.fill("\n")
    return sum(logprobs) / max(1, len(logprobs)), child, steps + [gen.text.strip()]
