"""Several models as programs use them, for engine tests: the served models and what each
reads and produces, greedy tokens on a named model (several models generating at once), and a
snapshot saved on one model opened on another, refused with the program going on."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import Context, HostError, Model, Sampler, models


async def main(input: dict[str, Any]) -> Any:
    return await MODES[input["mode"]](input)


async def listing(input: dict[str, Any]) -> Any:
    cards = []
    for name in models():
        model = Model.load(name)
        cards.append({"name": model.name, "inputs": model.inputs, "outputs": model.outputs})
    return cards


async def _greedy(name: str, prompt: list[int], count: int) -> list[int]:
    with Context(Model.load(name)) as ctx:
        ctx.fill_tokens(prompt)
        generation = ctx.generate(Sampler.argmax(), max_tokens=count, stop_tokens=[])
        return await generation.collect_tokens()


async def greedy(input: dict[str, Any]) -> Any:
    """Each request's greedy tokens, all of them generating at once."""
    runs = [_greedy(r["model"], r["prompt"], r["tokens"]) for r in input["requests"]]
    return list(await asyncio.gather(*runs))


async def cross(input: dict[str, Any]) -> Any:
    """Saves a context of `saved_on` as `name`, opens that name with `opened_on`, then
    generates on `opened_on` to show the program goes on."""
    with Context(Model.load(input["saved_on"])) as ctx:
        await ctx.fill_tokens(input["prompt"]).flush()
        ctx.save(input["name"])
    try:
        Context.open(Model.load(input["opened_on"]), input["name"]).destroy()
        refused = None
    except HostError as err:
        refused = {"kind": err.kind, "message": err.message}
    Context.delete(Model.load(input["saved_on"]), input["name"])
    after = await _greedy(input["opened_on"], input["prompt"], 2)
    return {"refused": refused, "after": after}


async def missing(input: dict[str, Any]) -> Any:
    try:
        Model.load(input["name"])
    except HostError as err:
        return {"kind": err.kind, "message": err.message}
    return None


MODES = {"list": listing, "greedy": greedy, "cross": cross, "missing": missing}
