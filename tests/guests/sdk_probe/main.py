"""A test guest that exercises one SDK feature per mode (input {"mode": ...}) against the fake
host in tests/guests/fake_host.py."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import (
    Context,
    HostError,
    Probe,
    Sampler,
    get_model,
    http,
    messaging,
    runs,
    runtime,
)


async def main(input: Any) -> Any:
    if not isinstance(input, dict):
        return {"type": type(input).__name__, "value": input}
    return await MODES[input["mode"]](input)


async def chat(input: dict[str, Any]) -> Any:
    ctx = Context(get_model())
    ctx.system("be brief").user("hello").cue()
    generation = ctx.generate(max_tokens=input.get("max_tokens", 5))
    text = await generation
    return {"text": text, "prompt_tokens": generation.prompt_tokens, "stop": generation.stop_reason}


async def multi_turn(input: dict[str, Any]) -> Any:
    ctx = Context(get_model())
    first = await ctx.user("one").cue().generate(max_tokens=40)
    second = await ctx.user("two").cue().generate(max_tokens=3)
    await ctx.flush()
    return {"first": first, "second": second, "context": ctx.model.decode(ctx.tokens)}


async def gather(input: dict[str, Any]) -> Any:
    ctx = Context(get_model()).fill("w")
    await ctx.flush()
    branches = [ctx.fork() for _ in range(input["n"])]
    return await asyncio.gather(*(b.generate(max_tokens=3).collect_text() for b in branches))


async def stream(input: dict[str, Any]) -> Any:
    ctx = Context(get_model()).fill("go:")
    generation = ctx.generate(max_tokens=input["max_tokens"], stop_strings=input["stops"])
    pieces = [piece async for piece in generation]
    return {"pieces": pieces, "text": generation.text, "stop": generation.stop_reason}


async def _generated(input: dict[str, Any], stepped: bool) -> Any:
    """One generation, stepped one pass at a time or consumed whole, and what it left."""
    seed = input.get("seed")
    sampler = Sampler.argmax() if seed is None else Sampler.top_p(0.9, seed=seed)
    ctx = Context(get_model()).fill(input.get("prompt", "go:"))
    generation = ctx.generate(
        sampler, max_tokens=input["max_tokens"], stop_strings=input.get("stops", [])
    )
    if stepped:
        while not generation.done:
            await generation.step()
    else:
        await generation
    await ctx.flush()
    return {
        "tokens": generation.tokens,
        "text": generation.text,
        "stop": generation.stop_reason,
        "context": ctx.tokens,
    }


async def stepwise(input: dict[str, Any]) -> Any:
    return await _generated(input, stepped=True)


async def whole(input: dict[str, Any]) -> Any:
    return await _generated(input, stepped=False)


async def seeded(input: dict[str, Any]) -> Any:
    base = Context(get_model()).fill("q")
    await base.flush()

    async def draw(seed: int) -> list[int]:
        sampler = Sampler.multinomial(temperature=1.0, seed=seed)
        return await base.fork().generate(sampler, max_tokens=12).collect_tokens()

    return await asyncio.gather(draw(7), draw(7), draw(8))


async def errors(input: dict[str, Any]) -> Any:
    model = get_model()
    found: dict[str, str] = {}
    try:
        Context.open(model, "missing")
    except HostError as err:
        found["open"] = err.kind
    ctx = Context(model).fill("abc")
    for name, action in (("forward", ctx.forward), ("save", lambda: ctx.save("x"))):
        try:
            action()
        except RuntimeError as err:
            found[name] = str(err)
    await ctx.flush()
    try:
        await asyncio.gather(ctx.generate(max_tokens=2), ctx.generate(max_tokens=2))
    except RuntimeError as err:
        found["busy"] = str(err)
    return found


async def snapshot(input: dict[str, Any]) -> Any:
    model = get_model()
    prefix = Context(model).system("shared")
    await prefix.flush()
    prefix.save("snap")
    opened = Context.open(model, "snap", messages=[{"role": "system", "content": "shared"}])
    branch = opened.fork().user("q").cue()
    generation = branch.generate(max_tokens=2)
    await generation
    return {
        "snapshot_tokens": opened.info().tokens,
        "prompt_tokens": generation.prompt_tokens,
        "context": model.decode(branch.tokens),
    }


async def io(input: dict[str, Any]) -> Any:
    messaging.push("jobs", "job-1")
    async with messaging.subscribe("news") as sub:
        news = await sub.next()
    child = runtime.launch("other", {"x": 1})
    return {
        "pulled": await messaging.pull("jobs"),
        "news": news,
        "child": await child.result(),
        "runtime": [runtime.version(), runtime.instance_id(), runtime.user()],
    }


async def fetch(input: dict[str, Any]) -> Any:
    posted = await http.post(
        "http://echo.test/items", json={"n": 1}, headers={"x-key": "k"}, timeout=2.5
    )
    try:
        await http.get("http://denied.test/")
        denied = None
    except HostError as err:
        denied = err.kind
    return {"echo": posted.json(), "type": posted.headers["content-type"], "denied": denied}


async def raw_forward(input: dict[str, Any]) -> Any:
    model = get_model()
    ctx = Context(model)
    fwd = ctx.forward().input([ord("a"), ord("b"), ord("c")], positions=[0, 1, 2])
    fwd.attention_mask([runs([True]), runs([True, True]), runs([True, False, True])])
    fwd.logit_mask(runs([True] * model.vocab_size))
    fwd.sample([0, 2], Sampler.argmax()).probe([2], Probe.distribution(2)).probe(
        [2], Probe.entropy()
    )
    out = await fwd.execute()
    return {"tokens": out[:2], "dist": out[2].tokens, "entropy": round(out[3], 3)}


async def sleep(input: dict[str, Any]) -> Any:
    await asyncio.sleep(0.02)
    return "slept"


async def deadlock(input: dict[str, Any]) -> Any:
    await asyncio.Event().wait()


async def unjson(input: dict[str, Any]) -> Any:
    return {1, 2}


MODES = {
    "chat": chat,
    "multi-turn": multi_turn,
    "gather": gather,
    "stream": stream,
    "stepwise": stepwise,
    "whole": whole,
    "seeded": seeded,
    "errors": errors,
    "snapshot": snapshot,
    "io": io,
    "fetch": fetch,
    "forward": raw_forward,
    "sleep": sleep,
    "deadlock": deadlock,
    "unjson": unjson,
}
