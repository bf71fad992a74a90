"""The `context` interface: contexts and snapshots, each call a command to the kv actor."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance

from pie.events import kv as ev
from pie.events.speculation import LaneBusy
from pie.sandbox.host.model import model_view
from pie.sandbox.host.records import ModelView
from pie.sandbox.host.state import HostFailure, current, host_call
from pie.sandbox.wasm import add_host_func, record

INTERFACE = "pie:inferlet/context@0.1.0"


def _ask(view: ModelView, make: Any, **fields: Any) -> Any:
    """A command to the kv actor of `view`'s model, and its reply."""
    state = current()
    event = make(corr=state.next_corr(), requester=state.address, **fields)
    return state.request(view.kv, event)


def _kv(make: Any, *, context: int, **fields: Any) -> Any:
    """A command about `context`, to the kv actor of its model."""
    return _ask(current().model_of(context), make, context=context, **fields)


def changing(ctx: int, *, running_ok: bool = False) -> None:
    """Ends the context's generation run and takes the context off the fast path before a
    command that changes its pages."""
    state = current()
    state.runs.end(ctx)
    lanes = state.model_of(ctx).lanes
    if lanes is not None:
        try:
            lanes.close(ctx, state.address, running_ok=running_ok)
        except LaneBusy as busy:
            raise HostFailure("busy", str(busy)) from None


def create(model: int) -> int:
    context: int = _ask(model_view(model), ev.CreateContext, user=current().user).context
    return context


def open_(model: int, name: str) -> int:
    view = model_view(model)
    context: int = _ask(view, ev.OpenContext, name=name, user=current().user).context
    return context


def take(model: int, name: str) -> int:
    view = model_view(model)
    context: int = _ask(view, ev.OpenContext, name=name, user=current().user, take=True).context
    return context


def delete(model: int, name: str) -> None:
    _ask(model_view(model), ev.DeleteSnapshot, name=name, user=current().user)


def fork(ctx: int) -> int:
    changing(ctx)
    context: int = _kv(ev.ForkContext, context=ctx).context
    return context


def save(ctx: int, name: str) -> None:
    changing(ctx)
    _kv(ev.SaveContext, context=ctx, name=name, user=current().user)


def destroy(ctx: int) -> None:
    changing(ctx, running_ok=True)
    _kv(ev.DestroyContext, context=ctx)


def truncate(ctx: int, count: int) -> None:
    changing(ctx)
    _kv(ev.TruncateContext, context=ctx, count=count)


def reserve(ctx: int, count: int) -> None:
    _kv(ev.ReserveTokens, context=ctx, count=count)


def mask_pages(ctx: int, pages: list[int], masked: bool) -> None:
    changing(ctx)
    _kv(ev.MaskPages, context=ctx, pages=tuple(pages), masked=masked)


def release_pages(ctx: int, pages: list[int]) -> None:
    changing(ctx)
    _kv(ev.ReleasePages, context=ctx, pages=tuple(pages))


def info(ctx: int) -> Any:
    described: ev.ContextInfo = _kv(ev.DescribeContext, context=ctx)
    return record(
        tokens=len(described.tokens),
        pages=described.pages + described.reserved_pages,
        reserved_pages=described.reserved_pages,
        next_position=described.next_position,
        masked_pages=list(described.masked_pages),
        released_pages=list(described.released_pages),
    )


def tokens(ctx: int) -> list[int]:
    described: ev.ContextInfo = _kv(ev.DescribeContext, context=ctx)
    return list(described.tokens)


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "open", host_call(open_))
    for fn in (
        create,
        take,
        delete,
        fork,
        save,
        destroy,
        truncate,
        reserve,
        mask_pages,
        release_pages,
        info,
    ):
        add_host_func(instance, fn.__name__.replace("_", "-"), host_call(fn))
    add_host_func(instance, "tokens", host_call(tokens))
