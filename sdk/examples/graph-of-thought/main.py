"""Graph-of-thought: independent thoughts generated in branches off one prompt, an aggregation
node that reads them all and merges them, and a refinement node that improves the merge. The
result lists every node with the nodes it was built from."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import Context, Sampler, get_model


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    task, k = input["task"], int(input.get("thoughts", 3))
    seed = int(input.get("seed", 0))
    tokens = int(input.get("tokens", 40))
    prompt = Context(model)
    prompt.user(f"{task}\nGive one idea.").cue()
    await prompt.flush()
    branches = [prompt.fork() for _ in range(k)]
    thoughts = await asyncio.gather(
        *(
            b.generate(
                Sampler.multinomial(temperature=0.9, seed=seed + i), max_tokens=tokens
            ).collect_text()
            for i, b in enumerate(branches)
        )
    )
    nodes: list[dict[str, Any]] = [
        {"id": i, "kind": "thought", "text": t, "from": []} for i, t in enumerate(thoughts)
    ]
    ideas = "\n".join(f"{i + 1}. {t.strip()}" for i, t in enumerate(thoughts))
    merge = Context(model)
    merge.user(f"{task}\nCombine the best of these ideas into one answer:\n{ideas}").cue()
    merged = await merge.generate(max_tokens=tokens * 2).collect_text()
    nodes.append({"id": k, "kind": "aggregate", "text": merged, "from": list(range(k))})
    merge.user("Improve that answer: make it clearer and shorter.").cue()
    refined = await merge.generate(max_tokens=tokens * 2).collect_text()
    nodes.append({"id": k + 1, "kind": "refine", "text": refined, "from": [k]})
    return {"nodes": nodes, "answer": refined}
