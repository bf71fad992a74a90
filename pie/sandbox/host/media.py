"""The `media` interface: images, video and audio from encoded bytes, decoded and prepared by
the model's media store on the guest thread, held per instance within a bound, and appended to
a context in one pass through the context's kv actor."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance

from pie.events import kv as ev
from pie.sandbox.host.model import model_view
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
            "quota", f"{len(state.media)} media items held; free one first (max_items_per_inferlet)"
        )
    try:
        item = view.media.add(kind, bytes(data), max_frames)
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
    media.release(item.key)


def append(ctx: int, handle: int) -> int:
    """Submits the media's span as one pass at the context's next position."""
    state = current()
    model, item = _held(state, handle)
    view = state.model_of(ctx)
    if view is not model_view(model):
        raise HostFailure(
            "wrong-model",
            f"media prepared for model {model_view(model).name!r} cannot go into a context of "
            f"model {view.name!r}",
        )
    from pie.sandbox.host.context import changing

    changing(ctx)
    described = state.request(
        view.kv,
        ev.DescribeContext(corr=state.next_corr(), requester=state.address, context=ctx),
    )
    start = described.positions[-1] + 1 if described.positions else 0
    assert view.media is not None
    tokens, positions, runs = view.media.place(item.key, start)
    event = ev.SubmitForward(
        corr=state.next_corr(),
        requester=state.address,
        context=ctx,
        tokens=tuple(tokens),
        positions=tuple(positions),
        media=runs,
    )
    return state.submit(view.kv, event, "forward")


def release_all(state: InstanceState) -> None:
    """Lets go of every item an ended instance still holds."""
    for model, item in state.media.values():
        media = state.models[model - 1].media
        if media is not None:
            media.release(item.key)
    state.media.clear()


def register(instance: LinkerInstance) -> None:
    for fn in (image_from_bytes, video_from_bytes, audio_from_bytes, info, free, append):
        add_host_func(instance, fn.__name__.replace("_", "-"), host_call(fn))
