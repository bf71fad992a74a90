"""The bus's pure core: named queues (each message to one puller, waiting pulls served in
order) and topics (each message to every subscriber). What it holds is bounded (a message's
size, the bytes parked on one queue and by one user, the pulls one requester has waiting) and a
name with nothing left is forgotten."""

from __future__ import annotations

import collections
from typing import Any

from attrs import define, frozen

from pie.config import BusConfig
from pie.events import bus as ev
from pie.events.bus import message_size
from pie.events.kv import Done, RequestFailed

Output = tuple[str, Any]

MESSAGE_OVERHEAD = 128
"""Bytes a queued message is charged beyond its text, so that empty messages still count."""


@frozen(kw_only=True)
class BusLimits:
    max_message_bytes: int = 1 << 20
    """A pushed or broadcast message's size in UTF-8; larger ones are refused `too-large`."""
    max_queue_messages: int = 10_000
    max_queue_bytes: int = 16 << 20
    """Bytes one queue may hold (each message charged its size plus MESSAGE_OVERHEAD)."""
    max_user_bytes: int = 64 << 20
    """Bytes one user's pushed messages may hold across all queues until they are pulled."""
    max_waiting_pulls: int = 1024
    """Pulls one requester may have waiting at once, on all queues; more fail `overrun`."""

    @classmethod
    def from_config(cls, config: BusConfig) -> BusLimits:
        return cls(
            max_message_bytes=config.max_message_kb << 10,
            max_queue_messages=config.max_queue_messages,
            max_queue_bytes=config.max_queue_mb << 20,
            max_user_bytes=config.max_user_mb << 20,
            max_waiting_pulls=config.max_waiting_pulls,
        )


def too_large(size: int, limit: int) -> tuple[str, str] | None:
    """The refusal (kind, message) of a message of `size` bytes over `limit`, else None."""
    if size > limit:
        return "too-large", f"the message is {size} bytes of UTF-8; the bus takes {limit}"
    return None


def park_refusal(
    limits: BusLimits, queue: str, user: str, reason: str, held: int
) -> tuple[str, str]:
    """The refusal (kind, message) of a message a queue cannot keep: `reason` is `full` (the
    queue holds `held` messages), `bytes` (it holds `held` bytes) or `quota` (`user` has `held`
    bytes waiting)."""
    if reason == "full":
        return "overrun", f"queue {queue!r} is full ({limits.max_queue_messages} messages)"
    if reason == "bytes":
        return "overrun", f"queue {queue!r} is full ({held} of {limits.max_queue_bytes} bytes)"
    return "quota", (
        f"user {user!r} already has {held} bytes of messages waiting on the bus; "
        f"at most {limits.max_user_bytes} until some are pulled"
    )


@frozen(kw_only=True)
class BusStatistics:
    queues: int
    queued_messages: int
    queued_bytes: int
    waiting_pulls: int
    topics: int
    subscriptions: int
    requesters: int
    """Requesters the bus holds a subscription or a waiting pull of."""
    delivered: int


@define
class _Queue:
    messages: collections.deque[tuple[str, str, int]]
    """(message, the user charged for it, its charge), oldest first."""
    bytes: int = 0


class BusCore:
    accepts = ev.BusCommand

    def __init__(self, limits: BusLimits | None = None) -> None:
        self.limits = limits or BusLimits()
        self._queues: dict[str, _Queue] = {}
        self._pullers: dict[str, collections.deque[tuple[str, int]]] = {}
        self._topics: dict[str, dict[str, int]] = {}
        self._user_bytes: dict[str, int] = {}
        # What each requester waits on and follows, so that its leaving touches only those names.
        self._pulling: dict[str, collections.Counter[str]] = {}
        self._following: dict[str, set[str]] = {}
        self._delivered = 0

    def handle(self, event: Any) -> list[Output]:
        match event:
            case ev.Push():
                return self._push(event)
            case ev.Pull():
                return self._pull(event)
            case ev.Publish():
                return self._publish(event)
            case ev.Subscribe():
                self._topics.setdefault(event.topic, {})[event.requester] = event.corr
                self._following.setdefault(event.requester, set()).add(event.topic)
                return [(event.requester, Done(corr=event.corr))]
            case ev.Unsubscribe():
                self._unsubscribe(event.requester, event.topic)
                return [(event.requester, Done(corr=event.corr))]
            case ev.LeaveBus():
                self._leave(event.requester)
                return [(event.requester, Done(corr=event.corr))]
        raise TypeError(f"bus got an unexpected event {type(event).__name__}")

    def waiting(self, queue: str) -> int:
        """Pulls waiting on `queue` (a bus whose messages live elsewhere serves them)."""
        return len(self._pullers.get(queue, ()))

    def waited_queues(self) -> list[str]:
        """The queues some pull waits on."""
        return list(self._pullers)

    def names(self) -> int:
        """Queue and topic names the bus holds anything for (its name tables' total size)."""
        return len(self._queues) + len(self._pullers) + len(self._topics)

    def _push(self, event: ev.Push) -> list[Output]:
        size = message_size(event.message)
        refusal = self._too_large(size)
        if refusal is None:
            waiting = self._pullers.get(event.queue)
            if waiting:
                return [self._hand_over(event, waiting), (event.requester, Done(corr=event.corr))]
            refusal = self._park(event, size + MESSAGE_OVERHEAD)
        if refusal is not None:
            kind, message = refusal
            return [(event.requester, RequestFailed(corr=event.corr, kind=kind, message=message))]
        return [(event.requester, Done(corr=event.corr))]

    def _too_large(self, size: int) -> tuple[str, str] | None:
        return too_large(size, self.limits.max_message_bytes)

    def _hand_over(self, event: ev.Push, waiting: collections.deque[tuple[str, int]]) -> Output:
        puller, corr = waiting.popleft()
        if not waiting:
            del self._pullers[event.queue]
        self._stop_pulling(puller, event.queue)
        self._delivered += 1
        return puller, ev.Pulled(corr=corr, queue=event.queue, message=event.message)

    def _park(self, event: ev.Push, charge: int) -> tuple[str, str] | None:
        """Keeps a message nobody waits for, within the queue's and the user's bounds."""
        limits = self.limits
        queue = self._queues.get(event.queue)
        held = (len(queue.messages), queue.bytes) if queue is not None else (0, 0)
        if held[0] >= limits.max_queue_messages:
            return park_refusal(limits, event.queue, "", "full", held[0])
        if held[1] + charge > limits.max_queue_bytes:
            return park_refusal(limits, event.queue, "", "bytes", held[1])
        user = event.user or event.requester
        owned = self._user_bytes.get(user, 0)
        if owned + charge > limits.max_user_bytes:
            return park_refusal(limits, event.queue, user, "quota", owned)
        if queue is None:
            queue = self._queues[event.queue] = _Queue(collections.deque())
        queue.messages.append((event.message, user, charge))
        queue.bytes += charge
        self._user_bytes[user] = owned + charge
        return None

    def _pull(self, event: ev.Pull) -> list[Output]:
        queue = self._queues.get(event.queue)
        if queue is None:
            return self._wait(event)
        message, user, charge = queue.messages.popleft()
        queue.bytes -= charge
        if not queue.messages:
            del self._queues[event.queue]
        self._release(user, charge)
        self._delivered += 1
        return [(event.requester, ev.Pulled(corr=event.corr, queue=event.queue, message=message))]

    def _wait(self, event: ev.Pull) -> list[Output]:
        """Keeps a pull until a message comes, within its requester's bound on waiting pulls."""
        pulling = self._pulling.get(event.requester, collections.Counter())
        most = self.limits.max_waiting_pulls
        if sum(pulling.values()) >= most:
            message = f"{event.requester} already has {most} pulls waiting (bus.max_waiting_pulls)"
            return [
                (event.requester, RequestFailed(corr=event.corr, kind="overrun", message=message))
            ]
        self._pullers.setdefault(event.queue, collections.deque()).append(
            (event.requester, event.corr)
        )
        pulling[event.queue] += 1
        self._pulling[event.requester] = pulling
        return []

    def _release(self, user: str, charge: int) -> None:
        left = self._user_bytes[user] - charge
        if left:
            self._user_bytes[user] = left
        else:
            del self._user_bytes[user]

    def _publish(self, event: ev.Publish) -> list[Output]:
        refusal = self._too_large(message_size(event.message))
        if refusal is not None:
            kind, message = refusal
            return [(event.requester, RequestFailed(corr=event.corr, kind=kind, message=message))]
        # Delivered to the subscribers of this moment and kept nowhere: nobody later sees it.
        subscribers = self._topics.get(event.topic, {})
        out: list[Output] = [
            (
                who,
                ev.TopicMessage(
                    corr=corr, topic=event.topic, sender=event.requester, message=event.message
                ),
            )
            for who, corr in subscribers.items()
        ]
        self._delivered += len(out)
        out.append((event.requester, Done(corr=event.corr)))
        return out

    def _unsubscribe(self, requester: str, topic: str) -> None:
        subscribers = self._topics.get(topic)
        if subscribers is None or subscribers.pop(requester, None) is None:
            return
        if not subscribers:
            del self._topics[topic]
        following = self._following[requester]
        following.discard(topic)
        if not following:
            del self._following[requester]

    def _stop_pulling(self, requester: str, queue: str) -> None:
        pulling = self._pulling[requester]
        pulling[queue] -= 1
        if not pulling[queue]:
            del pulling[queue]
            if not pulling:
                del self._pulling[requester]

    def _leave(self, requester: str) -> None:
        for topic in tuple(self._following.get(requester, ())):
            self._unsubscribe(requester, topic)
        for name in self._pulling.pop(requester, ()):
            left = collections.deque(w for w in self._pullers[name] if w[0] != requester)
            if left:
                self._pullers[name] = left
            else:
                del self._pullers[name]

    def statistics(self) -> BusStatistics:
        return BusStatistics(
            queues=len(self._queues),
            queued_messages=sum(len(q.messages) for q in self._queues.values()),
            queued_bytes=sum(q.bytes for q in self._queues.values()),
            waiting_pulls=sum(len(w) for w in self._pullers.values()),
            topics=len(self._topics),
            subscriptions=sum(len(s) for s in self._topics.values()),
            requesters=len(self._following.keys() | self._pulling.keys()),
            delivered=self._delivered,
        )
