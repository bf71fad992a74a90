"""LoRA adapters as programs use them, for engine tests: greedy tokens through an adapter (or
the base model) by a generation run, a stepped generation or raw forward passes, and an
unknown adapter refused with the program going on."""

from __future__ import annotations

from typing import Any

from inferlet import Context, HostError, Sampler, get_model


async def main(input: dict[str, Any]) -> dict[str, Any]:
    return await MODES[input["mode"]](input)


async def adapters(input: dict[str, Any]) -> dict[str, Any]:
    return {"adapters": get_model().adapters}


async def generate(input: dict[str, Any]) -> dict[str, Any]:
    """`tokens` greedy tokens after `prompt` through `adapter`, as `how` says: a run the engine
    carries ("run"), a generation stepped pass by pass ("stepped") or raw passes ("forward")."""
    with Context(get_model(), adapter=input["adapter"]) as ctx:
        ctx.fill_tokens(input["prompt"])
        if input["how"] == "forward":
            return {"tokens": await _forward(ctx, input["tokens"])}
        generation = ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop_tokens=[])
        if input["how"] == "run":
            return {"tokens": await generation.collect_tokens()}
        while not generation.done:
            await generation.step()
        return {"tokens": generation.tokens}


async def _forward(ctx: Context, count: int) -> list[int]:
    """Greedy tokens by raw passes; the context names no adapter, each pass names its own."""
    adapter, ctx.adapter = ctx.adapter, None
    feed, tokens = ctx.take_pending(), []
    for _ in range(count):
        fwd = ctx.forward().input(feed).adapter(adapter).sample([len(feed) - 1], Sampler.argmax())
        [token] = await fwd.execute()
        assert isinstance(token, int)
        tokens.append(token)
        feed = [token]
    return tokens


async def unknown(input: dict[str, Any]) -> dict[str, Any]:
    """A generation through an adapter the engine does not have, then one through a real one."""
    model = get_model()
    try:
        with Context(model, adapter="missing") as ctx:
            await ctx.fill_tokens(input["prompt"]).generate(max_tokens=2).collect_tokens()
        refused = None
    except HostError as err:
        refused = {"kind": err.kind, "message": err.message}
    with Context(model, adapter=input["adapter"]) as ctx:
        ctx.fill_tokens(input["prompt"])
        generation = ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop_tokens=[])
        return {"refused": refused, "tokens": await generation.collect_tokens()}


MODES = {"adapters": adapters, "generate": generate, "unknown": unknown}
