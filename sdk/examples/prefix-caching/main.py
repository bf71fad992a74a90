"""Prefix caching: the system prompt is prefilled once and saved as a named snapshot; every
request (in this run and later ones) forks from it and prefills only its own user turn."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from inferlet import Context, HostError, Model, get_model


async def main(input: dict[str, Any]) -> dict[str, Any]:
    system = input["system"]
    name = input.get("name") or "prefix-" + hashlib.sha256(system.encode()).hexdigest()[:16]
    max_tokens = int(input.get("max_tokens", 64))
    model = get_model()
    prefix, reused = await open_or_build(model, name, system)
    snapshot_tokens = prefix.info().tokens

    async def answer(prompt: str) -> dict[str, Any]:
        with prefix.fork() as ctx:
            generation = ctx.user(prompt).cue().generate(max_tokens=max_tokens)
            text = await generation.collect_text()
            return {"answer": text, "prefilled_tokens": generation.prompt_tokens}

    requests = await asyncio.gather(*(answer(p) for p in input["prompts"]))
    return {
        "snapshot": name,
        "reused": reused,
        "snapshot_tokens": snapshot_tokens,
        "requests": requests,
    }


async def open_or_build(model: Model, name: str, system: str) -> tuple[Context, bool]:
    """The snapshot as a context (and whether it already existed), building it when missing."""
    messages = [{"role": "system", "content": system}]
    try:
        return Context.open(model, name, messages=messages), True
    except HostError as err:
        if err.kind != "no-such-snapshot":
            raise
    prefix = Context(model).system(system)
    await prefix.flush()
    try:
        prefix.save(name)
    except HostError as err:
        # Another instance saved the same prefix first; its pages are just as good.
        if err.kind != "snapshot-exists":
            raise
    return prefix, False
