"""The `media` interface: images, video and audio from encoded bytes, decoded and prepared by
the model's media store on the guest thread, held within a per-instance and a per-user bound,
and laid out in a pass (appended alone, or among a forward pass's tokens) for the kv actor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from wasmtime.component import LinkerInstance

from pie.events import kv as ev
from pie.events.forward import MediaRun
from pie.sandbox.host.model import model_view
from pie.sandbox.host.records import ModelView
from pie.sandbox.host.state import HostFailure, InstanceState, current, host_call
from pie.sandbox.wasm import add_host_func, record

INTERFACE = "pie:inferlet/media@0.1.0"


def _add(model: int, kind: str, data: bytes, max_frames: int | None) -> int:
    state = current()
    view = model_view(model)
    if view.media is None or kind not in view.inputs:
        reads = ", ".join(view.inputs)
        tower = "audio" if kind == "audio" else "vision"
        raise HostFailure(
            "unsupported-media",
            f"model {view.name!r} has no {tower} tower for {kind} (it reads {reads})",
        )
    if len(state.media) >= state.max_media:
        raise HostFailure(
            "quota",
            f"this inferlet already holds {state.max_media} media items; free one first "
            "(media.max_items_per_inferlet)",
        )
    try:
        item = view.media.add(kind, bytes(data), max_frames, user=state.user)
    except ValueError as exc:
        raise HostFailure(getattr(exc, "kind", "bad-media"), str(exc)) from None
    handle = state.new_handle()
    state.media[handle] = (model, item)
    return handle


def image_from_bytes(model: int, data: bytes) -> int:
    return _add(model, "image", data, None)


def video_from_bytes(model: int, data: bytes, max_frames: int) -> int:
    return _add(model, "video", data, max_frames or None)


def audio_from_bytes(model: int, data: bytes) -> int:
    return _add(model, "audio", data, None)


def _held(state: InstanceState, handle: int) -> tuple[int, Any]:
    held = state.media.get(handle)
    if held is None:
        raise HostFailure("no-such-handle", f"no media handle {handle}")
    return held


def info(handle: int) -> Any:
    _, item = _held(current(), handle)
    prepared = item.prepared
    return record(
        kind=prepared.kind,
        tokens=prepared.token_count,
        soft_tokens=prepared.soft_count,
        grid=tuple(prepared.grid),
        hash=item.key,
    )


def free(handle: int) -> None:
    state = current()
    model, item = _held(state, handle)
    del state.media[handle]
    media = model_view(model).media
    assert media is not None
    media.release(item.key, user=state.user)


def append(ctx: int, handle: int) -> int:
    """Submits the media's span as one pass at the context's next position."""
    state = current()
    anchored = anchored_media(ctx, 0, [(handle, 0)])
    from pie.sandbox.host.context import changing

    changing(ctx)
    tokens, positions, runs = laid_out(ctx, (), anchored)
    event = ev.SubmitForward(
        corr=state.next_corr(),
        requester=state.address,
        context=ctx,
        tokens=tokens,
        positions=positions,
        media=runs,
    )
    return state.submit(state.model_of(ctx).kv, event, "forward")


Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[MediaRun, ...]]
Anchored = list[tuple[int, str]]


def anchored_media(ctx: int, count: int, inputs: Sequence[tuple[int, int]]) -> Anchored:
    """(anchor, media key) for each (media handle, anchor) a pass of `count` tokens into `ctx`
    names, checked and in anchor order (equal anchors keep their order)."""
    state = current()
    view = state.model_of(ctx)
    anchored = [
        (_anchor(i, anchor, count), _key_for(state, view, handle))
        for i, (handle, anchor) in enumerate(inputs)
    ]
    return sorted(anchored, key=lambda pair: pair[0])


def laid_out(ctx: int, tokens: Sequence[int], anchored: Anchored) -> Layout:
    """A pass's input with each (anchor, media key)'s span inserted just before input token
    `anchor`, laid out from the context's next position: (tokens, positions, media runs)."""
    state = current()
    view = state.model_of(ctx)
    assert view.media is not None
    out_tokens: list[int] = []
    positions: list[int] = []
    runs: list[MediaRun] = []
    at, done = _next_position(state, view.kv, ctx), 0
    for anchor, key in anchored:
        text = tokens[done:anchor]
        out_tokens.extend(text)
        positions.extend(range(at, at + len(text)))
        span, span_positions, span_runs = view.media.place(key, at + len(text))
        runs.extend(attrs.evolve(run, index=len(out_tokens) + run.index) for run in span_runs)
        out_tokens.extend(span)
        positions.extend(span_positions)
        # What follows continues after the span's last position, as the kv actor continues
        # after an appended medium (spans end in a delimiter placed past their largest index).
        at, done = span_positions[-1] + 1, anchor
    out_tokens.extend(tokens[done:])
    positions.extend(range(at, at + len(tokens) - done))
    return tuple(out_tokens), tuple(positions), tuple(runs)


def _anchor(index: int, anchor: int, count: int) -> int:
    if not 0 <= anchor <= count:
        raise HostFailure(
            "invalid", f"media[{index}].anchor is {anchor}, outside 0..{count} (the pass's tokens)"
        )
    return anchor


def _key_for(state: InstanceState, view: ModelView, handle: int) -> str:
    """The key of the media `handle` holds, if it was prepared for `view`'s model."""
    model, item = _held(state, handle)
    if view is not model_view(model):
        raise HostFailure(
            "wrong-model",
            f"media prepared for model {model_view(model).name!r} cannot go into a context of "
            f"model {view.name!r}",
        )
    key: str = item.key
    return key


def _next_position(state: InstanceState, kv: str, ctx: int) -> int:
    described = state.request(
        kv, ev.DescribeContext(corr=state.next_corr(), requester=state.address, context=ctx)
    )
    next_position: int = described.next_position
    return next_position


def release_all(state: InstanceState) -> None:
    """Lets go of every item an ended instance still holds."""
    for model, item in state.media.values():
        media = state.models[model - 1].media
        if media is not None:
            media.release(item.key, user=state.user)
    state.media.clear()


def register(instance: LinkerInstance) -> None:
    for fn in (image_from_bytes, video_from_bytes, audio_from_bytes, info, free, append):
        add_host_func(instance, fn.__name__.replace("_", "-"), host_call(fn))
