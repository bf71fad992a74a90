"""Generation runs as programs use them, for engine tests: a whole generation, a stepped one, and
a run interrupted after its first output by cancel, truncate, fork or destroy (through the raw
`generate` and `context` calls, so the interruption lands while the run is going)."""

from __future__ import annotations

from typing import Any

from inferlet import Context, HostError, Sampler, get_model
from inferlet._loop import ready
from inferlet.errors import call
from wit_world.imports import context as ctx_api
from wit_world.imports import generate as gen


async def main(input: dict[str, Any]) -> dict[str, Any]:
    return await MODES[input["mode"]](input)


def _sampler(input: dict[str, Any]) -> Sampler:
    seed = input.get("seed")
    return Sampler.argmax() if seed is None else Sampler.top_k(50, temperature=0.9, seed=seed)


async def whole(input: dict[str, Any]) -> dict[str, Any]:
    with Context(get_model()) as ctx:
        ctx.fill_tokens(input["prompt"])
        generation = ctx.generate(
            _sampler(input), max_tokens=input["tokens"], stop_tokens=input.get("stop", [])
        )
        tokens = await generation.collect_tokens()
        return {"tokens": tokens, "stop": generation.stop_reason}


async def stepped(input: dict[str, Any]) -> dict[str, Any]:
    with Context(get_model()) as ctx:
        ctx.fill_tokens(input["prompt"])
        generation = ctx.generate(
            _sampler(input), max_tokens=input["tokens"], stop_tokens=input.get("stop", [])
        )
        while not generation.done:
            await generation.step()
        return {"tokens": generation.tokens, "stop": generation.stop_reason}


async def _output(run: int) -> Any:
    pending = call(gen.next, run)
    await ready(pending)
    return call(gen.output, pending)


async def interrupt(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    ctx = Context(model)
    run = call(gen.start, _params(ctx, input["prompt"], input["tokens"], 1))
    first = await _output(run)
    tokens = list(first.tokens)
    fork_tokens: list[int] | None = None
    action = input["action"]
    if action == "cancel":
        call(gen.cancel, run)
    elif action == "truncate":
        call(ctx_api.truncate, ctx.handle, 1)
    elif action == "fork":
        fork = call(ctx_api.fork, ctx.handle)
        fork_tokens = list(call(ctx_api.tokens, fork))
    elif action == "destroy":
        ctx.destroy()
    out = first
    while out.finished is None:
        out = await _output(run)
        tokens.extend(out.tokens)
    written = None if action == "destroy" else list(call(ctx_api.tokens, ctx.handle))
    return {
        "finished": out.finished,
        "tokens": tokens,
        "written": written,
        "fork": fork_tokens,
        "final": out.final_token,
        "last_written": out.last_written,
    }


def _params(ctx: Context, prompt: list[int], tokens: int, every: int) -> Any:
    return gen.RunParams(
        context=ctx.handle,
        tokens=list(prompt),
        sampler=Sampler.argmax().slot_op(),
        max_tokens=tokens,
        stop_tokens=[],
        stop_strings=[],
        logit_mask=None,
        deliver_every=every,
        text=False,
        matcher=None,
        logit_bias=[],
        presence_penalty=0.0,
        frequency_penalty=0.0,
        window=None,
        adapter=None,
    )


async def busy(input: dict[str, Any]) -> dict[str, Any]:
    """A second run, or a pass of the program's own, on a context a run is carrying."""
    ctx = Context(get_model())
    run = call(gen.start, _params(ctx, input["prompt"], input["tokens"], 0))
    refused = {}
    try:
        call(gen.start, _params(ctx, [1], 2, 0))
    except HostError as err:
        refused["second run"] = err.kind
    try:
        await ctx.forward().input([1]).sample([0], Sampler.argmax()).execute()
    except HostError as err:
        refused["forward"] = err.kind
    out = await _output(run)
    return {"refused": refused, "tokens": list(out.tokens), "finished": out.finished}


MODES = {"whole": whole, "stepped": stepped, "interrupt": interrupt, "busy": busy}
