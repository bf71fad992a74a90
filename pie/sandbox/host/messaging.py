"""The `messaging` interface: queues (push/pull) and topics (broadcast/subscribe) on the bus."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance

from pie.events import bus as ev
from pie.sandbox.host.state import current, host_call
from pie.sandbox.wasm import add_host_func

INTERFACE = "pie:inferlet/messaging@0.1.0"


def _bus(make: Any, **fields: Any) -> Any:
    state = current()
    return state.request("bus", make(corr=state.next_corr(), requester=state.address, **fields))


def push(queue: str, message: str) -> None:
    _bus(ev.Push, queue=queue, message=message, user=current().user)


def pull(queue: str) -> int:
    state = current()
    event = ev.Pull(corr=state.next_corr(), requester=state.address, queue=queue)
    handle = state.submit("bus", event, "message")
    if state.trace is not None:
        state.trace.opened(handle, "pie.messaging.pull", event.corr, {"pie.queue": queue})
    return handle


def broadcast(topic: str, message: str) -> None:
    _bus(ev.Publish, topic=topic, message=message)


def subscribe(topic: str) -> int:
    return current().subscribe(topic)


def next_(sub: int) -> int:
    state = current()
    handle = state.next_message(sub)
    if state.trace is not None:
        state.trace.opened(handle, "pie.messaging.next")
    return handle


def unsubscribe(sub: int) -> None:
    topic = current().unsubscribe(sub)
    _bus(ev.Unsubscribe, topic=topic)


def message(pending: int) -> str:
    value = current().take(pending, "message")
    text: str = value.message if isinstance(value, ev.Pulled) else value
    return text


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "pull", pull)
    add_host_func(instance, "next", host_call(next_))
    for fn in (push, broadcast, subscribe, unsubscribe, message):
        add_host_func(instance, fn.__name__, host_call(fn))
