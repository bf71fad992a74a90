"""The `generate` interface: generation runs (runs.py) started, read and cancelled by a program.
Each step of a run goes the way `forward.execute` sends a pass, with a callback in place of a
pollable: a lane pass on the fast path, otherwise a SubmitForward to the kv actor."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from wasmtime.component import LinkerInstance

from pie.events import kv as ev
from pie.events import sampling as s
from pie.events.speculation import LaneBusy
from pie.grammar import GrammarError
from pie.sandbox.host.forward import attention_window, logit_biases, slot_op
from pie.sandbox.host.runs import Run, RunFailed, RunSpec, StepShape
from pie.sandbox.host.state import HostFailure, InstanceState, current, host_call
from pie.sandbox.wasm import add_host_func, record

INTERFACE = "pie:inferlet/generate@0.1.0"
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024


def start(params: Any) -> int:
    state = current()
    spec = run_spec(params)
    view = state.models[0]

    def decode(tokens: Any) -> str:
        with view.lock:
            text: str = view.tokenizer.decode(list(tokens))
        return text

    matcher = None
    if (bound := getattr(params, "matcher", None)) is not None:
        matcher = state.grammar.matcher(bound)
    handle = state.new_handle()
    corr = state.next_corr()
    step = _stepper(state, spec, corr)
    run = Run(spec, step, decode, lambda: state.runs.progressed(handle), matcher)
    state.runs.add(handle, run)
    try:
        run.start()
    except BaseException as exc:
        state.runs.remove(handle)
        if isinstance(exc, GrammarError):
            raise HostFailure(exc.kind, str(exc)) from None
        raise
    if state.trace is not None:
        shape = {"pie.context": spec.context, "pie.max_tokens": spec.max_tokens}
        state.trace.opened(handle, "pie.generate", corr, shape)
    return handle


def next_(run: int) -> int:
    return current().runs.next_output(run)


def output(pending: int) -> Any:
    state = current()
    handle: int = state.take(pending, "run")
    run = state.runs.get(handle)
    try:
        out = run.take()
    except RunFailed as failed:
        state.runs.remove(handle)
        if state.trace is not None:
            state.trace.closed(handle, failed.failure)
        raise HostFailure(failed.failure.kind, failed.failure.message) from None
    if out.finished is not None:
        state.runs.remove(handle)
        if state.trace is not None:
            generated = len(run.tokens)
            state.trace.closed(
                handle, None, {"pie.finished": out.finished, "pie.generated": generated}
            )
    return record(
        tokens=list(out.tokens),
        text=out.text,
        finished=out.finished,
        final_token=out.final_token,
        last_written=out.last_written,
    )


def cancel(run: int) -> None:
    current().runs.get(run).cancel()


def run_spec(params: Any) -> RunSpec:
    """The run a program asks for, checked: a sampler, bounded stop strings, sane counts."""
    op = slot_op(params.sampler)
    if not isinstance(op, s.SAMPLERS):
        raise HostFailure("invalid", "a run needs a sampler, not a probe")
    stops = tuple(getattr(params, "stop-strings"))
    if len(stops) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_STRING_CHARS for x in stops):
        raise HostFailure(
            "invalid",
            f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} chars",
        )
    mask = getattr(params, "logit-mask")
    if not params.tokens:
        raise HostFailure("invalid", "a run needs at least one token to feed")
    if getattr(params, "max-tokens") < 1:
        raise HostFailure("invalid", "max_tokens must be at least 1")
    try:
        return RunSpec(
            context=params.context,
            feed=tuple(params.tokens),
            op=op,
            max_tokens=getattr(params, "max-tokens"),
            stop_tokens=frozenset(getattr(params, "stop-tokens")),
            stop_strings=stops,
            logit_mask=None if mask is None else tuple(mask),
            logit_bias=logit_biases(getattr(params, "logit-bias")),
            presence_penalty=_penalty(params, "presence-penalty"),
            frequency_penalty=_penalty(params, "frequency-penalty"),
            deliver_every=getattr(params, "deliver-every"),
            text=params.text,
            window=attention_window(getattr(params, "window", None)),
            adapter=getattr(params, "adapter", None),
        )
    except (TypeError, ValueError) as exc:
        raise HostFailure("invalid", str(exc)) from None


MAX_PENALTY = 2.0


def _penalty(params: Any, name: str) -> float:
    value = float(getattr(params, name))
    if not -MAX_PENALTY <= value <= MAX_PENALTY:
        raise HostFailure("invalid", f"{name}: a value from -2 to 2")
    return value


def _stepper(state: InstanceState, spec: RunSpec, first_corr: int) -> Callable[..., None]:
    """Sends one step of the run: on its lane when the context has one and the step fits it,
    else through the kv actor (which may grant a lease for the next step). A windowed run's
    first step goes through the kv actor, which releases pages and grants a lease that ends
    with the tail page, so that every later step that starts a page comes back to it. The
    first step's correlation id is `first_corr`, which names the run in its trace."""
    view = state.model_of(spec.context)
    lanes = view.lanes
    window_pending = spec.window is not None
    corrs = itertools.chain((first_corr,), iter(state.next_corr, None))

    def step(
        tokens: tuple[int, ...],
        op: s.SlotOp,
        shape: StepShape,
        deliver: Callable[[Any], None],
    ) -> None:
        nonlocal window_pending
        slots = (s.SamplingSlot(index=len(tokens) - 1, op=op),)
        corr = next(corrs)
        plain = shape.mask is None and shape.penalty is None and not spec.logit_bias
        if lanes is not None and window_pending:
            lanes.close(spec.context, state.address)
        elif lanes is not None and plain:
            try:
                if lanes.submit(
                    spec.context,
                    state.address,
                    corr,
                    tokens,
                    None,
                    slots,
                    deliver,
                    adapter=spec.adapter,
                ):
                    return
            except LaneBusy as busy:
                deliver(ev.RequestFailed(corr=corr, kind="busy", message=str(busy)))
                return
        event = ev.SubmitForward(
            corr=corr,
            requester=state.address,
            context=spec.context,
            tokens=tokens,
            positions=None,
            attention_masks=None,
            logit_mask=shape.mask,
            logit_bias=spec.logit_bias,
            penalty=shape.penalty,
            slots=slots,
            fast=lanes is not None,
            window=spec.window,
            adapter=spec.adapter,
        )
        window_pending = False
        state.submit_to(view.kv, event, deliver)

    return step


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "start", host_call(start))
    add_host_func(instance, "next", host_call(next_))
    add_host_func(instance, "output", host_call(output))
    add_host_func(instance, "cancel", host_call(cancel))
