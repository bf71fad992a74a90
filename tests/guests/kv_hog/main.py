"""A test guest that goes after the KV pool and the probes: input {"mode": ...} picks how.

hog: reserves pages on new contexts until refused, reports the refusal and holds the pages
until the client says so. prompt: one pass of `tokens` tokens. good: a short greedy
generation. save: saves snapshots of `pages` pages each until refused. keep: saves one snapshot
`name` of `tokens` tokens. open: opens snapshot `name`. keep and open report the snapshot's
tokens and the greedy token after it and token 7. probe: one pass with `slots` probe slots of
the given kind. Each refusal is reported as {"refused": kind}."""

from __future__ import annotations

import json
from typing import Any

from inferlet import Context, HostError, Probe, Sampler, get_model, session


async def main(input: dict[str, Any]) -> Any:
    return await MODES[input["mode"]](input)


async def hog(input: dict[str, Any]) -> Any:
    model = get_model()
    held: list[Context] = []
    try:
        for _ in range(100_000):
            ctx = Context(model)
            held.append(ctx)
            ctx.reserve(1)
    except HostError as err:
        session.send(json.dumps({"refused": err.kind, "contexts": len(held) - 1}))
    await session.receive()
    return {"held": len(held) - 1}


async def prompt(input: dict[str, Any]) -> Any:
    with Context(get_model()) as ctx:
        ctx.fill_tokens([1 + i % 50 for i in range(input["tokens"])])
        try:
            await ctx.flush()
        except HostError as err:
            return {"refused": err.kind, "message": err.message}
        return {"tokens": len(ctx.tokens)}


async def good(input: dict[str, Any]) -> Any:
    with Context(get_model()) as ctx:
        ctx.fill_tokens(input["prompt"])
        generation = ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop_tokens=[])
        return {"tokens": await generation.collect_tokens()}


async def save(input: dict[str, Any]) -> Any:
    model = get_model()
    for n in range(10_000):
        with Context(model) as ctx:
            ctx.fill_tokens([1 + (n * 7 + i) % 50 for i in range(input["tokens"])])
            await ctx.flush()
            try:
                ctx.save(f"s{n}")
            except HostError as err:
                return {"refused": err.kind, "message": err.message, "saved": n}
    return {"saved": 10_000}


async def keep(input: dict[str, Any]) -> Any:
    with Context(get_model()) as ctx:
        ctx.fill_tokens([1 + i % 50 for i in range(input["tokens"])])
        await ctx.flush()
        ctx.save(input["name"])
        return await _after(ctx)


async def open_saved(input: dict[str, Any]) -> Any:
    try:
        ctx = Context.open(get_model(), input["name"])
    except HostError as err:
        return {"refused": err.kind}
    with ctx:
        return await _after(ctx)


async def _after(ctx: Context) -> Any:
    tokens = ctx.tokens
    ctx.fill_tokens([7])
    generation = ctx.generate(Sampler.argmax(), max_tokens=1, stop_tokens=[])
    return {"tokens": tokens, "next": await generation.collect_tokens()}


PROBES = {
    "distribution": lambda input: Probe.distribution(input.get("k", 5)),
    "logits": lambda input: Probe.raw_logits(),
    "entropy": lambda input: Probe.entropy(),
}


async def probe(input: dict[str, Any]) -> Any:
    with Context(get_model()) as ctx:
        count = input["slots"]
        fwd = ctx.forward().input([1 + i % 50 for i in range(input.get("tokens", count))])
        fwd.probe(range(count), PROBES[input["probe"]](input))
        try:
            results = await fwd.execute()
        except HostError as err:
            return {"refused": err.kind, "message": err.message}
        return {"outputs": len(results)}


MODES = {
    "hog": hog,
    "prompt": prompt,
    "good": good,
    "save": save,
    "keep": keep,
    "open": open_saved,
    "probe": probe,
}
