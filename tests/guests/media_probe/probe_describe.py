"""Media as programs use them, for engine tests: a picture between two runs of tokens and greedy
tokens after it (in several contexts at once, and in a fork), and the refusals a program gets
for media its model cannot take, going on afterwards."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from inferlet import Audio, Context, HostError, Image, Model, Sampler


async def _describe(model: Model, data: bytes, before: list[int], after: list[int], n: int) -> Any:
    image = Image.from_bytes(model, data)
    with Context(model) as ctx:
        ctx.fill_tokens(before)
        await ctx.append_image(image)
        ctx.fill_tokens(after)
        generation = ctx.generate(Sampler.argmax(), max_tokens=n, stop_tokens=[])
        tokens = await generation.collect_tokens()
        forked = ctx.fork()
    image.free()
    return {
        "tokens": tokens,
        "count": image.token_count(),
        "grid": list(image.grid()),
        "context_tokens": len(forked.tokens),
    }


async def describe(input: dict[str, Any]) -> Any:
    """Each picture's greedy tokens, all of them at once."""
    model = Model.load(input.get("model", ""))
    pictures = [base64.b64decode(p) for p in input["images"]]
    runs = [_describe(model, p, input["before"], input["after"], input["tokens"]) for p in pictures]
    return list(await asyncio.gather(*runs))


async def refusals(input: dict[str, Any]) -> Any:
    """Each (model, kind, bytes) refused with its kind and message."""
    seen = []
    for case in input["cases"]:
        model = Model.load(case["model"])
        data = base64.b64decode(case["data"])
        try:
            kind = Image if case["kind"] == "image" else Audio
            kind.from_bytes(model, data).free()
            seen.append(None)
        except HostError as err:
            seen.append({"kind": err.kind, "message": err.message})
    return seen


MODES = {"describe": describe, "refusals": refusals}
