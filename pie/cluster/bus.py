"""The bus of a clustered node, at the address `bus`: queues live in Redis (so a push on one
node is pulled on any), topics are published on a Redis stream every node reads (so every
node's subscribers hear them, all in one order), and the local BusCore keeps this node's
waiting pulls and subscriptions, with the local bus's bounds and refusals throughout."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from pie.actors.bus import (
    MESSAGE_OVERHEAD,
    BusCore,
    BusLimits,
    BusStatistics,
    park_refusal,
    too_large,
)
from pie.actors.runtime import Actor, Router
from pie.cluster.bus_store import RedisQueues, TopicFrame, decoded
from pie.cluster.store import STORE_ERRORS, open_store, reason, redacted, retry_delay
from pie.config import ClusterConfig
from pie.events import bus as ev
from pie.events.bus import message_size
from pie.events.kv import Done, RequestFailed

log = logging.getLogger(__name__)

HERE = "bus:cluster"
"""The requester the local core answers for messages that came through Redis (dropped)."""


class ClusterBus(Actor):
    """Start with `await nursery.start(bus.run)`; it ends when the router closes its mailbox."""

    accepts = ev.BusCommand

    def __init__(
        self, router: Router, limits: BusLimits, config: ClusterConfig, origin: str
    ) -> None:
        super().__init__("bus", router, capacity=65536)
        self.core = BusCore(limits)
        self.limits = limits
        self.config = config
        self.origin = origin
        """This node's name on the messages it publishes."""
        self._queues: RedisQueues | None = None
        self._lock = trio.Lock()
        self._delivered = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with open_store(self.config.redis, self.config.connect_timeout_seconds) as store:
            self._queues = RedisQueues(store, self.limits, self.config.bus_stream_entries)
            async with trio.open_nursery() as nursery:
                await nursery.start(self._listen)
                nursery.start_soon(self._sweep)
                await super().run(task_status=task_status)
                nursery.cancel_scope.cancel()

    async def handle(self, event: Any) -> None:
        async with self._lock:
            match event:
                case ev.Push():
                    self._reply(event, await self._push(event))
                case ev.Pull():
                    self.emit(self.core.handle(event))
                    await self._serve(event.queue)
                case ev.Publish():
                    self._reply(event, await self._publish(event))
                case _:
                    self.emit(self.core.handle(event))

    def statistics(self) -> BusStatistics:
        """This node's waiting pulls and subscriptions; its queues are in Redis, not counted."""
        local = self.core.statistics()
        return BusStatistics(
            queues=0,
            queued_messages=0,
            queued_bytes=0,
            waiting_pulls=local.waiting_pulls,
            topics=local.topics,
            subscriptions=local.subscriptions,
            requesters=local.requesters,
            delivered=self._delivered,
        )

    # -- commands ------------------------------------------------------------------------

    async def _push(self, event: ev.Push) -> tuple[str, str] | None:
        size = message_size(event.message)
        refusal = too_large(size, self.limits.max_message_bytes) or self._long("queue", event.queue)
        if refusal is not None:
            return refusal
        user = event.user or event.requester
        assert self._queues is not None
        try:
            refused = await self._queues.push(
                event.queue, event.message, user, size + MESSAGE_OVERHEAD
            )
        except STORE_ERRORS as exc:
            return self._unavailable(exc)
        if refused is not None:
            return park_refusal(self.limits, event.queue, user, refused.reason, refused.held)
        await self._serve(event.queue)
        return None

    async def _publish(self, event: ev.Publish) -> tuple[str, str] | None:
        refusal = too_large(message_size(event.message), self.limits.max_message_bytes)
        refusal = refusal or self._long("topic", event.topic)
        if refusal is not None:
            return refusal
        assert self._queues is not None
        try:
            await self._queues.publish(self.origin, event.requester, event.topic, event.message)
        except STORE_ERRORS as exc:
            return self._unavailable(exc)
        return None

    def _long(self, kind: str, name: str) -> tuple[str, str] | None:
        """A name Redis would keep (in a key and on the stream) is bounded."""
        size, most = message_size(name), self.config.bus_max_name_bytes
        if size > most:
            return "invalid", (
                f"the {kind} name is {size} bytes of UTF-8; a cluster's bus takes at most {most} "
                f"(cluster.bus_max_name_bytes)"
            )
        return None

    def _reply(self, event: Any, refusal: tuple[str, str] | None) -> None:
        if refusal is None:
            reply: Any = Done(corr=event.corr)
        else:
            kind, message = refusal
            reply = RequestFailed(corr=event.corr, kind=kind, message=message)
        self.emit([(event.requester, reply)])

    def _unavailable(self, exc: BaseException) -> tuple[str, str]:
        where = redacted(self.config.redis)
        return "unavailable", f"the cluster's bus at {where} did not answer ({reason(exc)})"

    # -- deliveries ------------------------------------------------------------------------

    async def _serve(self, queue: str) -> bool:
        """Hands the queue's oldest messages in Redis to this node's waiting pulls, in order;
        False when Redis did not answer (the sweep tries again). Callers hold the lock, so no
        pull leaves between taking a message and handing it."""
        assert self._queues is not None
        while self.core.waiting(queue):
            try:
                message = await self._queues.pop(queue)
            except STORE_ERRORS:
                return False
            if message is None:
                break
            self._hand_over(queue, message)
        return True

    def _hand_over(self, queue: str, message: str) -> None:
        push = ev.Push(corr=0, requester=HERE, queue=queue, message=message)
        self._delivered += 1
        self.emit([out for out in self.core.handle(push) if out[0] != HERE])

    def _heard(self, frame: TopicFrame) -> None:
        sender = frame.sender if frame.origin == self.origin else f"{frame.sender}@{frame.origin}"
        publish = ev.Publish(corr=0, requester=HERE, topic=frame.topic, message=frame.message)
        outputs = [out for out in self.core.handle(publish) if out[0] != HERE]
        self._delivered += len(outputs)
        self.emit([(who, _from(message, sender)) for who, message in outputs])

    async def _listen(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Reads the stream from its end at start, every entry in order, for the bus's life;
        while Redis is away it tries again (bus_poll_seconds apart, doubling up to
        reconnect_max_seconds) and goes on where it was."""
        assert self._queues is not None
        last = await self._queues.last_entry()
        task_status.started()
        wait_ms = int(min(1.0, self.config.connect_timeout_seconds / 2) * 1000)
        failures = 0
        while True:
            try:
                entries = await self._queues.read_after(last, wait_ms)
            except STORE_ERRORS:
                failures += 1
                cap = self.config.reconnect_max_seconds
                await trio.sleep(retry_delay(self.config.bus_poll_seconds, failures - 1, cap))
                continue
            failures = 0
            for entry, fields in entries:
                last = entry
                try:
                    await self._entry(fields)
                except Exception:  # one bad entry must not stop the node's bus
                    log.exception("pie: the cluster's bus could not deliver a message")

    async def _entry(self, fields: dict[Any, Any]) -> None:
        if b"t" in fields:
            self._heard(TopicFrame.parse(fields[b"t"]))
            return
        queue = decoded(fields[b"q"])
        if self.core.waiting(queue):
            async with self._lock:
                await self._serve(queue)

    async def _sweep(self) -> None:
        """Serves waiting pulls every poll_seconds too, for pushes whose word was lost while
        Redis was away."""
        while True:
            await trio.sleep(self.config.bus_poll_seconds)
            async with self._lock:
                for queue in self.core.waited_queues():
                    if not await self._serve(queue):
                        break  # Redis is away: the bus's commands should not wait on each queue


def _from(message: Any, sender: str) -> Any:
    if isinstance(message, ev.TopicMessage):
        return ev.TopicMessage(
            corr=message.corr, topic=message.topic, sender=sender, message=message.message
        )
    return message


def cluster_bus(config: ClusterConfig, limits: BusLimits, origin: str) -> Callable[[Router], Actor]:
    """What the engine builds its `bus` from on a clustered node."""
    return lambda router: ClusterBus(router, limits, config, origin)
