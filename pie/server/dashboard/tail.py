"""The dashboard's live tails of the event log: each a filter and a bounded queue fed on the Trio
thread by the log's listener, which drops (and counts) what a slow reader has no room for."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

import trio
from attrs import frozen

from pie.config import DashboardConfig
from pie.eventlog import Envelope
from pie.eventlog.records import Row
from pie.events import codec

MAX_ACTOR_CHARS = 200
MAX_DETAIL_CHARS = 400
"""An event's fields are shown up to this many characters of their JSON."""


class Refusal(Exception):
    """A dashboard request refused: the HTTP status, a stable kind and what to do about it."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


@frozen(kw_only=True)
class TailFilter:
    """Which envelopes a tail shows: those to or from `actor` (and, for an inferlet's address,
    those about that instance), with correlation id `corr`; None matches any."""

    actor: str | None = None
    corr: int | None = None

    @classmethod
    def from_query(cls, query: bytes) -> TailFilter:
        """The filter in a query string (`actor=inferlet:i1&corr=12`); Refusal (400) when a
        value is malformed."""
        try:
            fields = parse_qs(query.decode("ascii"), max_num_fields=8)
        except (UnicodeDecodeError, ValueError) as exc:
            raise Refusal(400, "bad_request", f"unreadable query string: {exc}") from None
        actor = fields.get("actor", [""])[-1] or None
        if actor is not None and len(actor) > MAX_ACTOR_CHARS:
            raise Refusal(400, "bad_request", f"actor is over {MAX_ACTOR_CHARS} characters")
        corr = fields.get("corr", [""])[-1]
        if corr and not corr.isdigit():
            raise Refusal(400, "bad_request", f"corr must be a whole number, got {corr!r}")
        return cls(actor=actor, corr=int(corr) if corr else None)

    def matches(self, envelope: Envelope) -> bool:
        if self.corr is not None and envelope.corr != self.corr:
            return False
        if self.actor is None or self.actor in (envelope.src, envelope.dst):
            return True
        instance = _instance(envelope.event)
        return instance is not None and self.actor == f"inferlet:{instance}"


class Tail:
    """One reader's queue: `receive` yields the envelopes its filter matched, in order."""

    def __init__(self, user: str, filter: TailFilter, buffer: int) -> None:
        self.user = user
        self.filter = filter
        self._send, self.receive = trio.open_memory_channel[Envelope](buffer)
        self.dropped = 0
        """Envelopes that matched while the queue was full."""

    def offer(self, envelope: Envelope) -> bool:
        """Queues `envelope` if there is room; never waits."""
        try:
            self._send.send_nowait(envelope)
        except trio.WouldBlock:
            self.dropped += 1
            return False
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    def close(self) -> None:
        """The reader gets what is queued, then the end of the channel."""
        self._send.close()


@frozen(kw_only=True)
class TailStatistics:
    open: int
    dropped: int
    """Envelopes dropped for readers that fell behind, all tails together since the start."""
    refused: int


class TailHub:
    """The open tails and the recent envelopes a new one starts with. `hear` is the event log's
    listener: it runs on the Trio thread for every delivery, so it only filters and queues."""

    def __init__(self, config: DashboardConfig) -> None:
        self.config = config
        self._tails: list[Tail] = []
        self._recent: collections.deque[Row] = collections.deque(maxlen=config.tail_backlog)
        self._dropped = 0
        self._refused = 0

    def hear(self, row: Row) -> None:
        self._recent.append(row)
        if not self._tails:
            return
        envelope = Envelope.from_row(row)
        for tail in self._tails:
            if tail.filter.matches(envelope) and not tail.offer(envelope):
                self._dropped += 1

    def open(self, user: str, filter: TailFilter) -> Tail:
        """A new tail, holding the recent envelopes its filter matches; Refusal (429) past
        either bound."""
        config = self.config
        if sum(t.user == user for t in self._tails) >= config.max_tails_per_user:
            self._refused += 1
            raise Refusal(
                429,
                "too_many_tails",
                f"user {user!r} has {config.max_tails_per_user} event tails open already "
                "(dashboard.max_tails_per_user): close one first",
            )
        if len(self._tails) >= config.max_tails:
            self._refused += 1
            raise Refusal(
                429,
                "too_many_tails",
                f"{config.max_tails} event tails are open already (dashboard.max_tails)",
            )
        tail = Tail(user, filter, config.tail_buffer)
        recent = [e for e in map(Envelope.from_row, self._recent) if filter.matches(e)]
        for envelope in recent[-config.tail_buffer :]:
            tail.offer(envelope)
        self._tails.append(tail)
        return tail

    def close(self, tail: Tail) -> None:
        if tail in self._tails:
            self._tails.remove(tail)
        tail.close()

    def close_all(self) -> None:
        for tail in list(self._tails):
            self.close(tail)

    def statistics(self) -> TailStatistics:
        return TailStatistics(open=len(self._tails), dropped=self._dropped, refused=self._refused)


def render(envelopes: Sequence[Envelope], dropped: int | None) -> bytes:
    """JSON lines for a reader: one per envelope, then (given `dropped`) a status line. Runs off
    the Trio thread: events are frozen, so reading them there is safe."""
    lines = [json.dumps(envelope_record(e), separators=(",", ":")) for e in envelopes]
    if dropped is not None:
        status = {"type": "status", "time": time.time(), "dropped": dropped}
        lines.append(json.dumps(status, separators=(",", ":")))
    return "".join(line + "\n" for line in lines).encode()


def envelope_record(envelope: Envelope) -> dict[str, Any]:
    """What a reader is sent of one envelope: who, when, the event's type and its fields (the
    correlation id apart, the JSON cut to MAX_DETAIL_CHARS)."""
    data = codec.encode(envelope.event)
    kind = data.pop(codec.TAG)
    data.pop("corr", None)
    detail = json.dumps(data, separators=(",", ":"))
    if len(detail) > MAX_DETAIL_CHARS:
        detail = detail[: MAX_DETAIL_CHARS - 3] + "..."
    return {
        "type": "event",
        "seq": envelope.seq,
        "time": envelope.time,
        "src": envelope.src,
        "dst": envelope.dst,
        "corr": envelope.corr,
        "instance": _instance(envelope.event),
        "kind": kind,
        "detail": detail,
    }


def _instance(event: Any) -> str | None:
    """The inferlet instance an event is about, if it names one."""
    instance = getattr(event, "instance", None)
    return instance if isinstance(instance, str) else None
