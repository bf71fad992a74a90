"""The `forward` interface: a pass becomes one SubmitForward to the kv actor; its outputs come
back through a pollable. This is the per-token path, so it does as little as it can."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance, Variant

from pie.events import kv as ev
from pie.events import sampling as s
from pie.events.speculation import LaneBusy
from pie.sandbox.host.state import HostFailure, current, host_call
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
    state.runs.forbid(pass_.context)
    positions = _get(pass_, "positions")
    masks = _get(pass_, "attention-masks")
    logit_mask = _get(pass_, "logit-mask")
    bias = logit_biases(_get(pass_, "logit-bias"))
    penalty = _penalty(_get(pass_, "penalty"))
    window = attention_window(_get(pass_, "window"))
    adapter: str | None = _get(pass_, "adapter")
    tokens = tuple(pass_.tokens)
    slots = _slots(pass_.slots)
    positions = None if positions is None else tuple(positions)
    view = state.model_of(pass_.context)
    lanes = view.lanes
    if lanes is not None:
        context = pass_.context
        try:
            plain = masks is None and logit_mask is None and not bias and penalty is None
            # A window releases pages as the pass is placed: only the kv actor does that.
            if plain and window is None:
                corr = state.next_corr()
                handle, fill = state.expect("forward")
                if lanes.submit(
                    context, state.address, corr, tokens, positions, slots, fill, adapter=adapter
                ):
                    return handle
                state.discard(handle)
            else:
                lanes.close(context, state.address)
        except LaneBusy as busy:
            raise HostFailure("busy", str(busy)) from None
    event = ev.SubmitForward(
        corr=state.next_corr(),
        requester=state.address,
        context=pass_.context,
        tokens=tokens,
        positions=positions,
        attention_masks=None if masks is None else tuple(tuple(m) for m in masks),
        logit_mask=None if logit_mask is None else tuple(logit_mask),
        logit_bias=bias,
        penalty=penalty,
        slots=slots,
        fast=lanes is not None,
        window=window,
        adapter=adapter,
    )
    return state.submit(view.kv, event, "forward")


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
