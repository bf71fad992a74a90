"""What an instance's topic subscriptions hold between the bus delivering a message and the
guest asking for it, within a per-subscription and a per-instance bound, the oldest dropped
first. Every method runs under the instance's condition."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pie.events import bus as bus_ev
from pie.events.bus import message_size
from pie.events.kv import RequestFailed
from pie.sandbox.host.failure import HostFailure
from pie.sandbox.host.records import Subscription

Fill = Callable[[int, Any], None]
"""Completes a pollable by its handle."""


class TopicBuffers:
    def __init__(self, *, messages: int, subscription_bytes: int, total_bytes: int) -> None:
        self.messages = messages
        """What one subscription's buffer may hold, in messages."""
        self.subscription_bytes = subscription_bytes
        """What one subscription's buffer may hold, in bytes of UTF-8."""
        self.total_bytes = total_bytes
        """What the buffers of all this instance's subscriptions may hold together."""
        self.buffered = 0
        self.subscriptions: dict[int, Subscription] = {}
        self._by_corr: dict[int, int] = {}

    def add(self, sub: int, topic: str, corr: int) -> None:
        if any(existing.topic == topic for existing in self.subscriptions.values()):
            raise HostFailure("invalid", f"already subscribed to {topic!r}")
        self.subscriptions[sub] = Subscription(topic, corr)
        self._by_corr[corr] = sub

    def get(self, sub: int) -> Subscription:
        subscription = self.subscriptions.get(sub)
        if subscription is None:
            raise HostFailure("no-such-handle", f"no subscription {sub}")
        return subscription

    def remove(self, sub: int) -> Subscription:
        subscription = self.get(sub)
        del self.subscriptions[sub]
        self._by_corr.pop(subscription.corr, None)
        self.buffered -= subscription.bytes
        return subscription

    def message(self, event: bus_ev.TopicMessage, fill: Fill) -> None:
        sub = self._by_corr.get(event.corr)
        if sub is None:
            return
        subscription = self.subscriptions[sub]
        size = message_size(event.message)
        subscription.messages.append((event.message, size))
        subscription.bytes += size
        self.buffered += size
        self.feed(subscription, fill)
        while (
            len(subscription.messages) > self.messages
            or subscription.bytes > self.subscription_bytes
        ):
            self._drop_oldest(subscription)
        while self.buffered > self.total_bytes:
            self._drop_oldest(max(self.subscriptions.values(), key=lambda s: s.bytes))

    def feed(self, subscription: Subscription, fill: Fill) -> None:
        # The oldest messages go first, so a loss is reported before the messages kept after it.
        if subscription.dropped and subscription.waiting:
            message = f"{subscription.dropped} messages on {subscription.topic!r} were dropped"
            overrun = RequestFailed(corr=0, kind="overrun", message=message)
            fill(subscription.waiting.popleft(), overrun)
            subscription.dropped = 0
        while subscription.messages and subscription.waiting:
            message, size = subscription.messages.popleft()
            subscription.bytes -= size
            self.buffered -= size
            fill(subscription.waiting.popleft(), message)

    def _drop_oldest(self, subscription: Subscription) -> None:
        _, size = subscription.messages.popleft()
        subscription.bytes -= size
        self.buffered -= size
        subscription.dropped += 1
