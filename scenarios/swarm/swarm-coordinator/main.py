"""The swarm's coordinator: launches a planner, writers, a critic and an editor (one agent
program, a role each), starts the pipeline once every agent listens, and returns the editor's
answer with every agent's report."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from inferlet import HostError, messaging, runtime


async def main(input: dict[str, Any]) -> str:
    run, angles = input["run"], list(input["angles"])
    roles = [{"role": "planner"}]
    roles += [{"role": "writer", "angle": angle} for angle in angles]
    roles += [{"role": "critic"}, {"role": "editor"}]
    common = {"run": run, "writers": len(angles)}
    # Agents someone else launches (on another node of a cluster): by their place in `roles`.
    elsewhere = set(input.get("elsewhere", ()))
    # Subscribed before any agent starts, so the answer cannot be broadcast unheard.
    answers = messaging.subscribe(f"{run}/answer")
    agents = [
        (spec["role"], runtime.launch(input["agent"], {**common, **spec}))
        for index, spec in enumerate(roles)
        if index not in elsewhere
    ]

    async def pipeline() -> str:
        for _ in roles:
            await messaging.pull(f"{run}/ready")
        messaging.push(f"{run}/task", input["task"])
        return json.loads(await answers.next())["text"]

    answer, *reports = await asyncio.gather(
        pipeline(), *(report(role, child) for role, child in agents)
    )
    answers.unsubscribe()
    return json.dumps({"answer": answer, "agents": reports})


async def report(role: str, child: runtime.Child) -> dict[str, Any]:
    """What the agent returned; an agent that fails fails the whole swarm at once, naming it."""
    try:
        return json.loads(await child.result())
    except HostError as err:
        raise RuntimeError(f"the {role} failed: {err}") from None
