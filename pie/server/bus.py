"""One connection's use of the messaging bus: the topics it watches, each through a requester of
its own so that ending a watch leaves nothing behind on the bus, and the messages it broadcasts
and pushes as an inferlet would."""

from __future__ import annotations

import itertools
import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
from attrs import define

from pie.actors.requester import Requester
from pie.events import bus as bus_ev
from pie.events.bus import TopicMessage
from pie.server.hub import Refused
from pie.wire import messages as msg

if TYPE_CHECKING:
    from pie.engine import Engine

MAX_NAME_BYTES = 256
MAX_WATCHES = 64
"""Topics one connection may watch at once."""


@define
class _Watch:
    scope: trio.CancelScope
    ended: trio.Event


class BusAccess:
    """Start with `await nursery.start(access.run)`; its watches end when that nursery does."""

    def __init__(self, engine: Engine, connection: int, post: Callable[[Any], None]) -> None:
        self._engine = engine
        self._connection = connection
        self._post = post
        self._watches: dict[str, _Watch] = {}
        self._watch_ids = itertools.count(1)
        self._sender: Requester | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def watch(self, topic: str) -> None:
        """Returns once the bus delivers the topic's messages to this connection."""
        check_name("topic", topic)
        if topic in self._watches:
            raise Refused("already-watching", f"this connection already watches {topic!r}")
        if len(self._watches) >= MAX_WATCHES:
            raise Refused("busy", f"a connection may watch at most {MAX_WATCHES} topics")
        assert self._nursery is not None
        await self._nursery.start(self._forward, topic)

    async def unwatch(self, topic: str) -> None:
        """Returns once the subscription is gone from the bus and no more of its messages come."""
        watch = self._watches.get(topic)
        if watch is None:
            raise Refused("not-watching", f"this connection does not watch {topic!r}")
        watch.scope.cancel()
        await watch.ended.wait()

    async def publish(self, topic: str, message: str) -> None:
        check_name("topic", topic)
        self._check_message(message)
        await (await self._requester()).publish(topic, message)

    async def push(self, queue: str, message: str, user: str) -> None:
        """Queues `message` as `user`'s: it counts against that user's bytes on the bus."""
        check_name("queue", queue)
        self._check_message(message)
        requester = await self._requester()
        await requester.call("bus", bus_ev.Push, queue=queue, message=message, user=user)

    def _check_message(self, message: str) -> None:
        check_message(message, self._engine.config.bus.max_message_kb << 10)

    async def _forward(self, topic: str, *, task_status: trio.TaskStatus[None]) -> None:
        watch = _Watch(trio.CancelScope(), trio.Event())
        address = f"watch:{self._connection}.{next(self._watch_ids)}"
        try:
            with watch.scope:
                async with self._engine.requester(address) as requester:
                    await requester.subscribe(topic, lambda event: self._post(_watched(event)))
                    self._watches[topic] = watch
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            # The requester has closed by now, so the bus holds no subscription of this watch.
            if self._watches.get(topic) is watch:
                del self._watches[topic]
            watch.ended.set()

    async def _requester(self) -> Requester:
        """The connection's own bus address, opened on its first broadcast or push."""
        if self._sender is None:
            assert self._nursery is not None
            self._sender = await self._nursery.start(self._hold_requester)
        return self._sender

    async def _hold_requester(self, *, task_status: trio.TaskStatus[Requester]) -> None:
        async with self._engine.requester(f"session:{self._connection}") as requester:
            task_status.started(requester)
            await trio.sleep_forever()


def _watched(event: TopicMessage) -> msg.WatchedMessage:
    return msg.WatchedMessage(topic=event.topic, sender=event.sender, message=event.message)


def check_name(kind: str, name: str) -> None:
    """Topic and queue names: non-empty Unicode text, no control characters, a bounded size."""
    if not name:
        raise Refused("bad-frame", f"the {kind} name is empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise Refused("bad-frame", f"the {kind} name is not valid Unicode") from None
    if size > MAX_NAME_BYTES:
        raise Refused(
            "bad-frame", f"the {kind} name is {size} bytes of UTF-8; at most {MAX_NAME_BYTES}"
        )
    if any(unicodedata.category(char) == "Cc" for char in name):
        raise Refused("bad-frame", f"the {kind} name {name!r} holds a control character")


def check_message(message: str, max_bytes: int) -> None:
    try:
        size = len(message.encode("utf-8"))
    except UnicodeEncodeError:
        raise Refused("bad-frame", "the message is not valid Unicode (a lone surrogate)") from None
    if size > max_bytes:
        raise Refused("too-large", f"the message is {size} bytes of UTF-8; at most {max_bytes}")
