"""The `forward` interface: a pass becomes one SubmitForward to the kv actor; its outputs come
back through a pollable. This is the per-token path, so it does as little as it can."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance, Variant

from pie.events import kv as ev
from pie.events import sampling as s
from pie.events.forward import MediaRun
from pie.events.speculation import LaneBusy
from pie.sandbox.host.media import anchored_media, laid_out
from pie.sandbox.host.ports import FastPath
from pie.sandbox.host.state import HostFailure, InstanceState, current, host_call
from pie.sandbox.wasm import add_host_func, record

INTERFACE = "pie:inferlet/forward@0.1.0"


def _get(value: Any, name: str) -> Any:
    return getattr(value, name)


def _seed(params: Any) -> int | None:
    seed: int | None = params.seed
    return seed


def slot_op(op: Any) -> s.SlotOp:
    p: Any
    tag, p = (op.tag, op.payload) if isinstance(op, Variant) else (op, None)
    match tag:
        case "argmax":
            return s.Argmax()
        case "multinomial":
            return s.Multinomial(temperature=p.temperature, seed=_seed(p))
        case "top-k":
            return s.TopK(k=p.k, temperature=p.temperature, seed=_seed(p))
        case "top-p":
            return s.TopP(p=p.p, temperature=p.temperature, seed=_seed(p))
        case "min-p":
            return s.MinP(p=p.p, temperature=p.temperature, seed=_seed(p))
        case "top-k-top-p":
            return s.TopKTopP(k=p.k, p=p.p, temperature=p.temperature, seed=_seed(p))
        case "distribution":
            return s.Distribution(k=p.k, temperature=p.temperature)
        case "raw-logits":
            return s.RawLogits()
        case "logprobs":
            return s.LogProbs(tokens=tuple(p))
        case "entropy":
            return s.Entropy()
    raise HostFailure("invalid", f"unknown slot op {tag!r}")


def _slots(slots: list[Any]) -> tuple[s.SamplingSlot, ...]:
    try:
        return tuple(s.SamplingSlot(index=slot.index, op=slot_op(slot.op)) for slot in slots)
    except (ValueError, TypeError) as exc:
        raise HostFailure("invalid", str(exc)) from exc


def logit_biases(biases: list[Any]) -> tuple[s.LogitBias, ...]:
    """The program's logit biases; their bounds are checked with the rest of the pass."""
    return tuple(s.LogitBias(mask=tuple(b.mask), value=float(b.value)) for b in biases)


def _penalty(given: Any) -> s.Penalty | None:
    if given is None:
        return None
    return s.Penalty(
        presence=float(given.presence),
        frequency=float(given.frequency),
        tokens=tuple(given.tokens),
    )


def attention_window(given: Any) -> ev.AttentionWindow | None:
    """The program's window; its bounds are checked by the kv actor."""
    if given is None:
        return None
    return ev.AttentionWindow(
        sink_pages=getattr(given, "sink-pages"), window_pages=getattr(given, "window-pages")
    )


def execute(pass_: Any) -> int:
    state = current()
    corr = state.next_corr()
    handle = _submit(state, pass_, corr)
    if state.trace is not None:
        shape = {"pie.context": pass_.context, "pie.tokens": len(pass_.tokens)}
        state.trace.opened(handle, "pie.forward", corr, shape)
    return handle


def _submit(state: InstanceState, pass_: Any, corr: int) -> int:
    """The pollable of the pass, sent on its context's lane or to the kv actor."""
    context = pass_.context
    state.runs.forbid(context)
    positions = _get(pass_, "positions")
    masks = _get(pass_, "attention-masks")
    logit_mask = _get(pass_, "logit-mask")
    bias = logit_biases(_get(pass_, "logit-bias"))
    penalty = _penalty(_get(pass_, "penalty"))
    window = attention_window(_get(pass_, "window"))
    adapter: str | None = _get(pass_, "adapter")
    inputs = [(given.media, given.anchor) for given in _get(pass_, "media")]
    tokens = tuple(pass_.tokens)
    slots = _slots(pass_.slots)
    positions = None if positions is None else tuple(positions)
    view = state.model_of(context)
    lanes = view.lanes
    runs: tuple[MediaRun, ...] = ()
    # A window releases pages as the pass is placed and media need their spans laid out:
    # only the kv actor does either.
    plain = masks is None and logit_mask is None and not bias and penalty is None
    if inputs:
        if positions is not None:
            raise HostFailure("invalid", "a pass with media takes no positions")
        anchored = anchored_media(context, len(tokens), inputs)
        _off_lanes(state, context)
        tokens, positions, runs = laid_out(context, tokens, anchored)
    elif lanes is not None and plain and window is None:
        handle = _on_lane(state, lanes, context, corr, tokens, positions, slots, adapter)
        if handle is not None:
            return handle
    else:
        _off_lanes(state, context)
    event = ev.SubmitForward(
        corr=corr,
        requester=state.address,
        context=context,
        tokens=tokens,
        positions=positions,
        attention_masks=None if masks is None else tuple(tuple(m) for m in masks),
        logit_mask=None if logit_mask is None else tuple(logit_mask),
        logit_bias=bias,
        penalty=penalty,
        slots=slots,
        fast=lanes is not None and not runs,
        window=window,
        adapter=adapter,
        media=runs,
    )
    return state.submit(view.kv, event, "forward")


def _on_lane(
    state: InstanceState,
    lanes: FastPath,
    context: int,
    corr: int,
    tokens: tuple[int, ...],
    positions: tuple[int, ...] | None,
    slots: tuple[s.SamplingSlot, ...],
    adapter: str | None,
) -> int | None:
    """The pollable of a plain pass the fast path took, or None when it did not."""
    handle, fill = state.expect("forward")
    try:
        taken = lanes.submit(
            context,
            state.address,
            corr,
            tokens,
            positions,
            slots,
            fill,
            adapter=adapter,
        )
    except LaneBusy as busy:
        state.discard(handle)
        raise HostFailure("busy", str(busy)) from None
    if taken:
        return handle
    state.discard(handle)
    return None


def _off_lanes(state: InstanceState, context: int) -> None:
    lanes = state.model_of(context).lanes
    if lanes is None:
        return
    try:
        lanes.close(context, state.address)
    except LaneBusy as busy:
        raise HostFailure("busy", str(busy)) from None


def _output(out: s.SlotOutput) -> Variant:
    match out:
        case s.TokenOutput():
            return Variant("token", out.token)
        case s.DistributionOutput():
            return Variant("distribution", record(tokens=list(out.tokens), probs=list(out.probs)))
        case s.LogitsOutput():
            return Variant("logits", list(out.values))
        case s.LogProbsOutput():
            return Variant("logprobs", list(out.values))
        case s.EntropyOutput():
            return Variant("entropy", out.value)
    raise AssertionError(f"unexpected output {out!r}")


def outputs(pending: int) -> list[Variant]:
    completed = current().take(pending, "forward")
    return [_output(out) for out in completed.outputs]


def step(pass_: Any) -> list[Variant]:
    handle = execute(pass_)
    current().wait_any([handle])
    return outputs(handle)


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "execute", host_call(execute))
    add_host_func(instance, "outputs", host_call(outputs))
    add_host_func(instance, "step", host_call(step))
