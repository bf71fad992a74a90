"""The bus's pure core: named queues (each message to one puller, waiting pulls served in
order) and topics (each message to every subscriber). Bounded, with a clear overrun error."""

from __future__ import annotations

import collections
from typing import Any

from attrs import frozen

from pie.events import bus as ev
from pie.events.kv import Done, RequestFailed

Output = tuple[str, Any]


@frozen(kw_only=True)
class BusStatistics:
    queues: int
    queued_messages: int
    waiting_pulls: int
    topics: int
    subscriptions: int
    delivered: int


class BusCore:
    accepts = ev.BusCommand

    def __init__(self, *, max_queue: int = 10_000) -> None:
        self.max_queue = max_queue
        self._queues: dict[str, collections.deque[str]] = {}
        self._pullers: dict[str, collections.deque[tuple[str, int]]] = {}
        self._topics: dict[str, dict[str, int]] = {}
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
                return [(event.requester, Done(corr=event.corr))]
            case ev.Unsubscribe():
                self._topics.get(event.topic, {}).pop(event.requester, None)
                return [(event.requester, Done(corr=event.corr))]
            case ev.LeaveBus():
                self._leave(event.requester)
                return [(event.requester, Done(corr=event.corr))]
        raise TypeError(f"bus got an unexpected event {type(event).__name__}")

    def _push(self, event: ev.Push) -> list[Output]:
        waiting = self._pullers.get(event.queue)
        if waiting:
            puller, corr = waiting.popleft()
            self._delivered += 1
            pulled = ev.Pulled(corr=corr, queue=event.queue, message=event.message)
            return [(puller, pulled), (event.requester, Done(corr=event.corr))]
        queue = self._queues.setdefault(event.queue, collections.deque())
        if len(queue) >= self.max_queue:
            message = f"queue {event.queue!r} is full ({self.max_queue} messages)"
            return [
                (event.requester, RequestFailed(corr=event.corr, kind="overrun", message=message))
            ]
        queue.append(event.message)
        return [(event.requester, Done(corr=event.corr))]

    def _pull(self, event: ev.Pull) -> list[Output]:
        queue = self._queues.get(event.queue)
        if queue:
            self._delivered += 1
            return [
                (
                    event.requester,
                    ev.Pulled(corr=event.corr, queue=event.queue, message=queue.popleft()),
                )
            ]
        self._pullers.setdefault(event.queue, collections.deque()).append(
            (event.requester, event.corr)
        )
        return []

    def _publish(self, event: ev.Publish) -> list[Output]:
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

    def _leave(self, requester: str) -> None:
        for subscribers in self._topics.values():
            subscribers.pop(requester, None)
        for name, waiting in self._pullers.items():
            self._pullers[name] = collections.deque(w for w in waiting if w[0] != requester)

    def statistics(self) -> BusStatistics:
        return BusStatistics(
            queues=len(self._queues),
            queued_messages=sum(len(q) for q in self._queues.values()),
            waiting_pulls=sum(len(w) for w in self._pullers.values()),
            topics=sum(1 for s in self._topics.values() if s),
            subscriptions=sum(len(s) for s in self._topics.values()),
            delivered=self._delivered,
        )
