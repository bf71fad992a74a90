"""Media put into passes that programs build themselves, for engine tests: greedy tokens after
pictures placed by `Forward.input_image` at anchors, the same tokens after the same pictures
appended between fills, the refusals of media passes, the program going on, media held
against the per-inferlet and per-user bounds, and a snapshot holding a picture saved and
resumed."""

from __future__ import annotations

import base64
from typing import Any

from inferlet import Context, HostError, Image, Model, Sampler, messaging
from inferlet.errors import call
from wit_world.imports import forward as fw


def _pictures(model: Model, input: dict[str, Any]) -> list[Image]:
    return [Image.from_bytes(model, base64.b64decode(p)) for p in input["images"]]


async def _rest(ctx: Context, first: int, count: int) -> list[int]:
    """`first` and the greedy tokens after it, `count` in all."""
    ctx.fill_tokens([first])
    generation = ctx.generate(Sampler.argmax(), max_tokens=count - 1, stop_tokens=[])
    return [first, *await generation.collect_tokens()]


async def anchored(input: dict[str, Any]) -> Any:
    """One pass of `tokens` with picture i before token `anchors[i]`, then greedy tokens."""
    model = Model.load("vl")
    pictures = _pictures(model, input)
    with Context(model) as ctx:
        fwd = ctx.forward().input(input["tokens"])
        for picture, anchor in zip(pictures, input["anchors"], strict=True):
            fwd.input_image(picture, anchor)
        total = len(input["tokens"]) + sum(p.token_count() for p in pictures)
        first = (await fwd.sample([total - 1], Sampler.argmax()).execute())[0]
        tokens = await _rest(ctx, first, input["count"])
        return {"tokens": tokens, "written": len(ctx.tokens), "next": ctx.info().next_position}


async def appended(input: dict[str, Any]) -> Any:
    """The same input as `anchored`, as fills and appended pictures, then greedy tokens."""
    model = Model.load("vl")
    pictures = _pictures(model, input)
    tokens, done = input["tokens"], 0
    with Context(model) as ctx:
        for picture, anchor in zip(pictures, input["anchors"], strict=True):
            await ctx.fill_tokens(tokens[done:anchor]).append_image(picture)
            done = anchor
        generation = ctx.fill_tokens(tokens[done:]).generate(
            Sampler.argmax(), max_tokens=input["count"], stop_tokens=[]
        )
        tokens = await generation.collect_tokens()
        return {"tokens": tokens, "written": len(ctx.tokens), "next": ctx.info().next_position}


def _refused(ctx: Context, tokens: list[int], media: list[fw.MediaInput], **extra: Any) -> Any:
    pass_ = fw.ForwardPass(
        context=ctx.handle,
        tokens=tokens,
        positions=extra.get("positions"),
        attention_masks=None,
        logit_mask=None,
        slots=[],
        logit_bias=[],
        penalty=None,
        window=None,
        adapter=None,
        media=media,
    )
    try:
        call(fw.step, pass_)
    except HostError as err:
        return {"kind": err.kind, "message": err.message}
    return None


async def refusals(input: dict[str, Any]) -> Any:
    """A media pass with an unknown handle, a medium of another model, an anchor past the
    tokens and explicit positions, each refused; then a good pass of `anchored`'s input."""
    model = Model.load("vl")
    picture = _pictures(model, input)[0]
    gone = Image.from_bytes(model, base64.b64decode(input["images"][0]))
    gone.free()
    seen = []
    with Context(Model.load("text")) as text, Context(model) as ctx:
        seen.append(_refused(ctx, [5], [fw.MediaInput(media=gone.handle, anchor=0)]))
        seen.append(_refused(text, [5], [fw.MediaInput(media=picture.handle, anchor=0)]))
        seen.append(_refused(ctx, [5, 6], [fw.MediaInput(media=picture.handle, anchor=3)]))
        media = [fw.MediaInput(media=picture.handle, anchor=1)]
        seen.append(_refused(ctx, [5, 6], media, positions=[0, 1]))
        written = len(ctx.tokens)
    good = await anchored(input)
    return {"refused": seen, "written": written, "after": good}


def _add(model: Model, data: bytes, held: list[Image]) -> Any:
    """Adds a picture to `held`, or the refusal's kind and message."""
    try:
        held.append(Image.from_bytes(model, data))
    except HostError as err:
        return {"kind": err.kind, "message": err.message}
    return None


async def hold(input: dict[str, Any]) -> Any:
    """Adds the picture `count` times, then (when `wait` names a queue) holds what it got until
    a message comes on it; each add's refusal or None."""
    model, data = Model.load("vl"), base64.b64decode(input["images"][0])
    held: list[Image] = []
    seen = [_add(model, data, held) for _ in range(input["count"])]
    if input.get("free_one"):
        held.pop().free()
        seen.append(_add(model, data, held))
    if input.get("signal"):
        messaging.push(input["signal"], "go")
    if input.get("wait"):
        await messaging.pull(input["wait"])
    for picture in held:
        picture.free()
    return seen


async def save(input: dict[str, Any]) -> Any:
    """Saves snapshot `name`: `tokens` with the picture before token `anchors[0]`."""
    model = Model.load("vl")
    picture = _pictures(model, input)[0]
    tokens, anchor = input["tokens"], input["anchors"][0]
    with Context(model) as ctx:
        await ctx.fill_tokens(tokens[:anchor]).append_image(picture)
        await ctx.fill_tokens(tokens[anchor:]).flush()
        ctx.save(input["name"])
    picture.free()
    return None


async def resume(input: dict[str, Any]) -> Any:
    """Greedy tokens after snapshot `name` (then deleted, when `delete` says so)."""
    model = Model.load("vl")
    with Context.open(model, input["name"]) as ctx:
        generation = ctx.generate(Sampler.argmax(), max_tokens=input["count"], stop_tokens=[])
        tokens = await generation.collect_tokens()
    if input.get("delete"):
        Context.delete(model, input["name"])
    return tokens


MODES = {
    "anchored": anchored,
    "appended": appended,
    "refusals": refusals,
    "hold": hold,
    "save": save,
    "resume": resume,
}
