"""Messages between inferlets: queues (each message to one puller) and topics (to every
subscriber)."""

from __future__ import annotations

from typing import Any

from wit_world.imports import messaging as _msg

from inferlet import _loop
from inferlet.errors import call


def push(queue: str, message: str) -> None:
    """Appends a message to a named queue shared by all inferlets."""
    call(_msg.push, queue, message)


async def pull(queue: str) -> str:
    """The next message of a queue."""
    handle = _msg.pull(queue)
    await _loop.ready(handle)
    return call(_msg.message, handle)


def broadcast(topic: str, message: str) -> None:
    """Sends a message to every current subscriber of a topic."""
    call(_msg.broadcast, topic, message)


def subscribe(topic: str) -> Subscription:
    return Subscription(call(_msg.subscribe, topic), topic)


class Subscription:
    """Messages on a topic from now on: `await sub.next()` or `async for message in sub`."""

    def __init__(self, handle: int, topic: str) -> None:
        self.handle = handle
        self.topic = topic
        self._closed = False

    async def next(self) -> str:
        if self._closed:
            raise RuntimeError(f"the subscription to {self.topic!r} was closed")
        handle = call(_msg.next, self.handle)
        await _loop.ready(handle)
        return call(_msg.message, handle)

    def unsubscribe(self) -> None:
        if not self._closed:
            self._closed = True
            call(_msg.unsubscribe, self.handle)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> str:
        return await self.next()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.unsubscribe()
