"""Decodes one prompt the way the request says and returns every token the context holds at
the end, so that runs with speculation off and on can be compared token for token.

Modes: "greedy", "top_p" (seeded nucleus), "min_p" and "top_k" (seeded), each as a generation
run and, with "_steps", stepped one pass at a time; "masked" (a logit mask on every step, raw
passes) and "masked_run" (the same as a run); "stop_run" / "stop_steps" (greedy until the stop
string in the request); and "course" (greedy, then truncate, then seeded top-p, then a masked
step, then greedy again).
"""

from __future__ import annotations

from typing import Any

from inferlet import Context, Sampler, get_model
from inferlet.forward import runs


async def masked_steps(ctx: Context, count: int, mask: list[int], first: list[int]) -> list[int]:
    """`count` greedy steps, each under `mask`, fed from `first` (the input of the first step)."""
    out: list[int] = []
    feed = first
    for _ in range(count):
        fwd = ctx.forward().input(feed).logit_mask(mask).sample([len(feed) - 1], Sampler.argmax())
        token = (await fwd.execute())[0]
        assert isinstance(token, int)
        out.append(token)
        feed = [token]
    return out


SAMPLERS = {
    "greedy": Sampler.argmax(),
    "top_p": Sampler.top_p(0.9, temperature=0.8, seed=7),
    "min_p": Sampler.min_p(0.05, temperature=0.9, seed=3),
    "top_k": Sampler.top_k(20, temperature=1.0, seed=5),
}


async def generated_by(ctx: Context, mode: str, count: int, input: dict[str, Any]) -> list[int]:
    """Runs and stepped generations of every sampler, and greedy until a stop string."""
    kind = mode.removesuffix("_steps").removesuffix("_run")
    stops = [input["stop"]] if kind == "stop" else []
    sampler = SAMPLERS.get(kind, Sampler.argmax())
    generation = ctx.generate(sampler, max_tokens=count, stop_strings=stops)
    if mode.endswith("_steps"):
        while not generation.done:
            await generation.step()
        return generation.tokens
    return await generation.collect_tokens()


async def main(input: dict[str, Any]) -> dict[str, Any]:
    mode = input["mode"]
    count = int(input.get("tokens", 12))
    model = get_model()
    # Only ids at or above `floor` may be sampled under the mask.
    floor = int(input.get("floor", 5000))
    mask = runs(i >= floor for i in range(model.vocab_size))
    generated: list[int] = []
    with Context(model) as ctx:
        ctx.user(input["prompt"]).cue()
        if mode.removesuffix("_steps") in SAMPLERS or mode in ("stop_run", "stop_steps"):
            generated = await generated_by(ctx, mode, count, input)
        elif mode == "masked_run":
            generation = ctx.generate(Sampler.argmax(), max_tokens=count, logit_mask=mask)
            generated = await generation.collect_tokens()
        elif mode == "masked":
            generated = await masked_steps(ctx, count, mask, ctx.take_pending())
        elif mode == "course":
            generated = await ctx.generate(Sampler.argmax(), max_tokens=count).collect_tokens()
            await ctx.flush()
            ctx.truncate(3)
            sampler = Sampler.top_p(0.9, temperature=0.8, seed=11)
            generated += await ctx.generate(sampler, max_tokens=count).collect_tokens()
            await ctx.flush()
            last = ctx.tokens[-1]
            ctx.truncate(1)
            generated += await masked_steps(ctx, 2, mask, [last])
            ctx.fill_tokens([generated[-1]])
            generated += await ctx.generate(Sampler.argmax(), max_tokens=count).collect_tokens()
        else:
            raise ValueError(f"unknown mode {mode!r}")
        await ctx.flush()
        return {"generated": generated, "context": ctx.tokens}
