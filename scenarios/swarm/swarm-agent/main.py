"""One agent of the swarm; its input names its role. Each agent subscribes to the topics it
reads, reports ready on a queue, waits for its input, takes its step with a short greedy
generation, broadcasts the result on its stage's topic and returns a report."""

from __future__ import annotations

import json
from typing import Any

from inferlet import Context, Sampler, get_model, messaging, runtime

ASSISTANT = "You are a helpful assistant. Answer briefly."


async def main(input: dict[str, Any]) -> str:
    step = {"planner": plan, "writer": write, "critic": criticise, "editor": edit}[input["role"]]
    text, heard = await step(input, input["run"])
    report = {"role": input["role"], "angle": input.get("angle"), "text": text, "heard": heard}
    return json.dumps({**report, "instance": runtime.instance_id()})


async def plan(input: dict[str, Any], run: str) -> tuple[str, list[str]]:
    messaging.push(f"{run}/ready", "planner")
    task = await messaging.pull(f"{run}/task")
    text = await generate(ASSISTANT, f"List three points to cover in {task}.", 20)
    publish(run, "plan", {"role": "planner", "task": task, "text": text})
    return text, ["task"]


async def write(input: dict[str, Any], run: str) -> tuple[str, list[str]]:
    angle = input["angle"]
    async with messaging.subscribe(f"{run}/plan") as plans:
        messaging.push(f"{run}/ready", f"writer:{angle}")
        the_plan = json.loads(await plans.next())
    task = the_plan["task"]
    role = f"You are a writer on a team. The team's plan: {the_plan['text']}"
    text = await generate(role, f"Write one sentence about {angle}.", 20)
    publish(run, "drafts", {"role": "writer", "angle": angle, "task": task, "text": text})
    return text, ["plan"]


async def criticise(input: dict[str, Any], run: str) -> tuple[str, list[str]]:
    async with messaging.subscribe(f"{run}/drafts") as drafts:
        messaging.push(f"{run}/ready", "critic")
        texts = await read_drafts(drafts, input["writers"])
    task = texts[0]["task"]
    prompt = (
        f"Here are drafts for {task}:\n{bullets(texts)}\n"
        "In one sentence, what should the editor improve?"
    )
    text = await generate(ASSISTANT, prompt, 16)
    publish(run, "critique", {"role": "critic", "task": task, "text": text})
    return text, ["drafts"] * len(texts)


async def edit(input: dict[str, Any], run: str) -> tuple[str, list[str]]:
    async with (
        messaging.subscribe(f"{run}/drafts") as drafts,
        messaging.subscribe(f"{run}/critique") as critiques,
    ):
        messaging.push(f"{run}/ready", "editor")
        texts = await read_drafts(drafts, input["writers"])
        critique = json.loads(await critiques.next())
    role = f"You are an editor. Advice: {critique['text']}"
    text = await generate(
        role, f"Combine these sentences into {critique['task']}:\n{bullets(texts)}", 32
    )
    publish(run, "answer", {"role": "editor", "text": text})
    return text, ["drafts"] * len(texts) + ["critique"]


async def generate(system: str, prompt: str, max_tokens: int) -> str:
    """A greedy reply to one user message after a system message."""
    with Context(get_model()) as ctx:
        ctx.system(system)
        ctx.user(prompt).cue()
        text = await ctx.generate(Sampler.argmax(), max_tokens=max_tokens).collect_text()
    return text.strip()


async def read_drafts(drafts: messaging.Subscription, count: int) -> list[dict[str, Any]]:
    """`count` drafts, by angle: they arrive in whatever order their writers finish."""
    texts = [json.loads(await drafts.next()) for _ in range(count)]
    return sorted(texts, key=lambda draft: draft["angle"])


def publish(run: str, stage: str, message: dict[str, Any]) -> None:
    messaging.broadcast(f"{run}/{stage}", json.dumps(message))


def bullets(drafts: list[dict[str, Any]]) -> str:
    return "\n".join(f"- {draft['text']}" for draft in drafts)
