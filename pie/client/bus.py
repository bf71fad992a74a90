"""Watched topics on the client side: each watch's queue of messages, filled by the connection's
reader task, and the handle a caller reads and stops it through."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from pie.client.errors import PieError, WatchOverflowed
from pie.wire.messages import WatchedMessage

WATCH_BUFFER = 65536
"""Messages one watch keeps unread before the client stops it (`WatchOverflowed`)."""


class Watch:
    """The messages broadcast on one topic since `Client.watch` returned, each a
    `WatchedMessage` (`topic`, `sender`, `message`): `async for message in watch`, or
    `await watch.next()`; `await watch.stop()` ends it. One reader at a time."""

    def __init__(self, topic: str, stop: Callable[[Watch], Awaitable[None]]) -> None:
        self.topic = topic
        self.send, self.receive = trio.open_memory_channel[WatchedMessage](WATCH_BUFFER)
        self.error: PieError | None = None
        """Why the watch broke off (None: stopped, or still going)."""
        self.stopped = False
        self._stop = stop

    async def next(self) -> WatchedMessage | None:
        """The next message, or None once stopped (after the messages already queued).
        Raises `ConnectionLost` or `WatchOverflowed` when the watch broke off."""
        try:
            return await self.receive.receive()
        except trio.EndOfChannel:
            if self.error is not None:
                raise self.error from None
            return None

    async def stop(self) -> None:
        """Stops watching; messages already queued stay readable."""
        if not self.stopped:
            await self._stop(self)

    def close(self, error: PieError | None = None) -> None:
        """No more messages come: stopped, or broke off with `error`."""
        if not self.stopped:
            self.stopped = True
            self.error = error
        self.send.close()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchedMessage:
        message = await self.next()
        if message is None:
            raise StopAsyncIteration
        return message

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"Watch({self.topic!r})"


class Watches:
    """A connection's watches by topic."""

    def __init__(self) -> None:
        self._by_topic: dict[str, Watch] = {}

    def open(self, topic: str, stop: Callable[[Watch], Awaitable[None]]) -> Watch:
        if topic in self._by_topic:
            raise PieError(f"this client already watches {topic!r}")
        watch = self._by_topic[topic] = Watch(topic, stop)
        return watch

    def deliver(self, message: WatchedMessage) -> Watch | None:
        """Queues a message for its watch; returns the watch when its queue was full, which is
        then closed with `WatchOverflowed` (the caller tells the server)."""
        watch = self._by_topic.get(message.topic)
        if watch is None:
            return None  # a topic this client stopped watching
        try:
            watch.send.send_nowait(message)
        except trio.WouldBlock:
            # Blocking here would stall every reply and stream on this connection.
            self.close(watch, WatchOverflowed(watch.topic, WATCH_BUFFER))
            return watch
        except trio.ClosedResourceError:
            pass
        return None

    def close(self, watch: Watch, error: PieError | None = None) -> None:
        if self._by_topic.get(watch.topic) is watch:
            del self._by_topic[watch.topic]
        watch.close(error)

    def close_all(self, error: PieError) -> None:
        for watch in list(self._by_topic.values()):
            self.close(watch, error)
