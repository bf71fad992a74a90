"""The server's bookkeeping of the inferlets it launched: owner, state, recent events and which
connections are attached. Pure (no I/O, no trio): the server feeds it events and the time."""

from __future__ import annotations

import collections
from typing import Any

import attrs
from attrs import define, field

from pie.events import inferlet as ev
from pie.wire.messages import InferletEvent, InferletSummary

Delivery = tuple[int, InferletEvent]
"""(connection id, the message for it)."""


class Refused(Exception):
    """A request about an inferlet that cannot be served; `kind` is a protocol failure kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@define
class Tracked:
    instance: str
    """The id clients know it by: the engine's own, or on a clustered node `ID@NODE`."""
    user: str
    program: str
    state: str
    """queued, running, stopping or ended."""
    events: collections.deque[InferletEvent] = field(factory=collections.deque)
    next_seq: int = 1
    attached: set[int] = field(factory=set)
    buffered_bytes: int = 0
    """What `events` holds, by `event_bytes`."""
    alone_since: float | None = None
    """When the last attached connection went; None while one is attached."""
    ended_at: float | None = None
    engine_id: str = ""
    """The engine's id for it (its events carry that one)."""

    @property
    def live(self) -> bool:
        return self.state != "ended"

    def summary(self) -> InferletSummary:
        return InferletSummary(
            instance=self.instance,
            program=self.program,
            user=self.user,
            state=self.state,
            attached=bool(self.attached),
        )


class Hub:
    def __init__(
        self,
        *,
        event_buffer: int = 4096,
        event_buffer_bytes: int = 32 << 20,
        user_buffer_bytes: int = 128 << 20,
        orphan_seconds: float = 600.0,
        retain_seconds: float = 600.0,
    ) -> None:
        self.event_buffer = event_buffer
        self.event_buffer_bytes = event_buffer_bytes
        self.user_buffer_bytes = user_buffer_bytes
        self.user_bytes: collections.Counter[str] = collections.Counter()
        """Bytes of buffered events per user, across their inferlets."""
        self.orphan_seconds = orphan_seconds
        self.retain_seconds = retain_seconds
        self.tracked: dict[str, Tracked] = {}
        self._by_engine_id: dict[str, Tracked] = {}

    def launched(
        self,
        instance: str,
        *,
        user: str,
        program: str,
        connection: int,
        queued: bool,
        engine_id: str = "",
    ) -> None:
        """A launch by `connection`, which is attached from the start; `instance` is the id
        clients see, `engine_id` the engine's when they differ."""
        state = "queued" if queued else "running"
        tracked = Tracked(
            instance=instance,
            user=user,
            program=program,
            state=state,
            attached={connection},
            engine_id=engine_id or instance,
        )
        self.tracked[instance] = self._by_engine_id[tracked.engine_id] = tracked

    def engine_id(self, instance: str) -> str:
        tracked = self.tracked.get(instance)
        return instance if tracked is None else tracked.engine_id

    def record(self, event: Any, now: float) -> list[Delivery]:
        """Buffers a lifecycle event and says which connections must get it."""
        tracked = self._by_engine_id.get(event.instance)
        if tracked is None:
            return []
        if tracked.instance != event.instance:
            event = attrs.evolve(event, instance=tracked.instance)
        message = InferletEvent(instance=tracked.instance, seq=tracked.next_seq, event=event)
        tracked.next_seq += 1
        self._buffer(tracked, message)
        if isinstance(event, ev.InferletStarted) and tracked.state == "queued":
            tracked.state = "running"
        elif isinstance(event, ev.InferletEnd):
            tracked.state = "ended"
            tracked.ended_at = now
        return [(connection, message) for connection in tracked.attached]

    def _buffer(self, tracked: Tracked, message: InferletEvent) -> None:
        """Keeps `message`, dropping the oldest events of the inferlet, then of its user's
        others, past the bounds; an inferlet's newest event (so its final one) always stays."""
        tracked.events.append(message)
        tracked.buffered_bytes += event_bytes(message.event)
        self.user_bytes[tracked.user] += event_bytes(message.event)
        while len(tracked.events) > 1 and (
            len(tracked.events) > self.event_buffer
            or tracked.buffered_bytes > self.event_buffer_bytes
        ):
            self._drop_oldest(tracked)
        if self.user_bytes[tracked.user] > self.user_buffer_bytes:
            for other in [t for t in self.tracked.values() if t.user == tracked.user]:
                while (
                    self.user_bytes[other.user] > self.user_buffer_bytes and len(other.events) > 1
                ):
                    self._drop_oldest(other)

    def _drop_oldest(self, tracked: Tracked) -> None:
        size = event_bytes(tracked.events.popleft().event)
        tracked.buffered_bytes -= size
        self.user_bytes[tracked.user] -= size

    def owned(self, user: str, instance: str) -> Tracked:
        """The tracked inferlet, if `user` owns it; raises Refused otherwise."""
        tracked = self.tracked.get(instance)
        if tracked is None:
            raise Refused("no-such-inferlet", f"no inferlet {instance!r}")
        if tracked.user != user:
            raise Refused("not-owner", f"inferlet {instance} belongs to another user")
        return tracked

    def live(self, user: str, instance: str) -> Tracked:
        tracked = self.owned(user, instance)
        if not tracked.live:
            raise Refused("no-such-inferlet", f"inferlet {instance} has ended")
        return tracked

    def attach(self, connection: int, user: str, instance: str, after: int) -> list[InferletEvent]:
        """Attaches `connection` and returns the buffered events it has not seen."""
        tracked = self.owned(user, instance)
        tracked.attached.add(connection)
        tracked.alone_since = None
        return [message for message in tracked.events if message.seq > after]

    def detach(self, connection: int, user: str, instance: str, now: float) -> None:
        tracked = self.owned(user, instance)
        self._leave(tracked, connection, now)

    def disconnected(self, connection: int, now: float) -> None:
        for tracked in self.tracked.values():
            if connection in tracked.attached:
                self._leave(tracked, connection, now)

    def _leave(self, tracked: Tracked, connection: int, now: float) -> None:
        tracked.attached.discard(connection)
        if not tracked.attached and tracked.alone_since is None:
            tracked.alone_since = now

    def stopping(self, instance: str) -> None:
        tracked = self.tracked.get(instance)
        if tracked is not None and tracked.live:
            tracked.state = "stopping"

    def due(self, now: float) -> list[str]:
        """Live inferlets alone for `orphan_seconds`, now marked stopping (the caller terminates
        them); ended ones past `retain_seconds` are forgotten."""
        orphans = []
        for tracked in list(self.tracked.values()):
            if not tracked.live:
                assert tracked.ended_at is not None
                if now - tracked.ended_at >= self.retain_seconds:
                    del self.tracked[tracked.instance]
                    del self._by_engine_id[tracked.engine_id]
                    self.user_bytes[tracked.user] -= tracked.buffered_bytes
            elif _alone_for(tracked, now) >= self.orphan_seconds and tracked.state != "stopping":
                tracked.state = "stopping"
                orphans.append(tracked.instance)
        return orphans

    def of_user(self, user: str) -> list[InferletSummary]:
        return [t.summary() for t in self.tracked.values() if t.user == user and t.live]

    def live_instances(self) -> list[str]:
        return [t.instance for t in self.tracked.values() if t.live]


EVENT_OVERHEAD_BYTES = 256


def event_bytes(event: Any) -> int:
    """About what a buffered event holds: its payload, if any, and a fixed overhead."""
    payloads = (getattr(event, name, None) for name in ("text", "data", "result", "error"))
    return EVENT_OVERHEAD_BYTES + sum(len(p) for p in payloads if isinstance(p, str | bytes))


def _alone_for(tracked: Tracked, now: float) -> float:
    return -1.0 if tracked.alone_since is None else now - tracked.alone_since
