"""The `speech` interface: text to speech on a model that speaks. A request is checked and
queued on the guest thread, stepped by the model's pass loop between forward passes, and its
clip held per instance within [media] bounds until freed or the instance ends."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from wasmtime.component import LinkerInstance

from pie.events.kv import RequestFailed
from pie.sandbox.host.model import model_view
from pie.sandbox.host.ports import SpeechPort
from pie.sandbox.host.records import ModelView, SpeechHolds
from pie.sandbox.host.state import HostFailure, InstanceState, current, host_call
from pie.sandbox.wasm import add_host_func, record

INTERFACE = "pie:inferlet/speech@0.1.0"


def _speaking(model: int) -> tuple[ModelView, SpeechPort, SpeechHolds]:
    view = model_view(model)
    if view.speech is None or view.speech_holds is None:
        produces = " and ".join(view.outputs)
        raise HostFailure(
            "unsupported-media", f"model {view.name!r} does not speak (it produces {produces})"
        )
    return view, view.speech, view.speech_holds


def voices(model: int) -> list[int]:
    _, port, _ = _speaking(model)
    return list(port.voices())


def max_seconds(model: int) -> float:
    _, _, holds = _speaking(model)
    return float(holds.limits.max_seconds)


def speak(model: int, text: str, speaker: int, max_seconds: float) -> int:
    """Queues a request on the model's pass loop; the pollable resolves to its clip."""
    state = current()
    view, port, holds = _speaking(model)
    if not text:
        raise HostFailure("invalid", "text: nothing to say")
    if speaker not in port.voices():
        raise HostFailure(
            "invalid", f"speaker: {speaker} is not one of the model's voices {list(port.voices())}"
        )
    limit = holds.limits.max_seconds
    if not (math.isfinite(max_seconds) and 0 < max_seconds <= limit):
        raise HostFailure(
            "invalid",
            f"max-seconds: {max_seconds} must be above 0 and at most {limit} "
            "(media.speech_max_seconds)",
        )
    ids = port.prompt_ids(text, speaker, _tokenize(view))
    frames = port.frames_for(max_seconds, len(ids))
    if frames < 1:
        raise HostFailure("invalid", f"text: {len(ids)} tokens leave the model no room to speak")
    holds.take(state.instance, state.user)
    handle, fill = state.expect("speech")
    try:
        port.speak(state.address, ids, frames, _delivery(state, holds, fill))
    except ValueError as exc:
        holds.give(state.instance, state.user)
        state.discard(handle)
        raise HostFailure("invalid", f"text: {exc}") from None
    return handle


def spoken(pending: int) -> int:
    """The clip a finished request produced, held until freed."""
    state = current()
    value = state.take(pending, "speech")
    handle = state.new_handle()
    state.clips[handle] = value
    return handle


def info(handle: int) -> Any:
    held = _held(current(), handle)
    return record(
        sample_rate=held.sample_rate,
        channels=held.channels,
        samples=int(held.samples.shape[1]),
        seconds=float(held.duration()),
    )


def wav(handle: int) -> bytes:
    data: bytes = _held(current(), handle).to_wav()
    return data


def samples(handle: int) -> bytes:
    """float32 little-endian samples, channels interleaved."""
    held = _held(current(), handle)
    return np.ascontiguousarray(held.samples.T).astype("<f4").tobytes()


def free(handle: int) -> None:
    state = current()
    _held(state, handle)
    del state.clips[handle]
    _holds(state).give(state.instance, state.user)


def release_all(state: InstanceState) -> None:
    """Drops an ended instance's requests and clips and counts them out."""
    for view in state.models:
        if view.speech is not None and view.speech_holds is not None:
            view.speech.cancel(state.address)
            view.speech_holds.give_all(state.instance, state.user)
    state.clips.clear()


def _delivery(
    state: InstanceState, holds: SpeechHolds, fill: Callable[[Any], None]
) -> Callable[[Any], None]:
    def deliver(value: Any) -> None:
        if isinstance(value, RequestFailed):
            holds.give(state.instance, state.user)
        fill(value)

    return deliver


def _tokenize(view: ModelView) -> Callable[[str], list[int]]:
    def encode(text: str) -> list[int]:
        with view.lock:
            return list(view.tokenizer.encode(text))

    return encode


def _held(state: InstanceState, handle: int) -> Any:
    held = state.clips.get(handle)
    if held is None:
        raise HostFailure("no-such-handle", f"no speech clip {handle}")
    return held


def _holds(state: InstanceState) -> SpeechHolds:
    holds = next((v.speech_holds for v in state.models if v.speech_holds is not None), None)
    assert holds is not None, "a clip exists only where a model speaks"
    return holds


def register(instance: LinkerInstance) -> None:
    for fn in (voices, max_seconds, speak, spoken, info, wav, samples, free):
        add_host_func(instance, fn.__name__.replace("_", "-"), host_call(fn))
