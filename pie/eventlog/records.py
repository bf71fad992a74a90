"""What the event log holds and writes: envelopes (one delivery each), the rows the ring keeps
them as, gap records (a stretch the file lacks), and their JSON lines."""

from __future__ import annotations

import json
from typing import Any, TypeAlias

from attrs import frozen

from pie.events import codec
from pie.events.recording import HostCallsRecorded

ENCODER = json.JSONEncoder(separators=(",", ":"))

Row: TypeAlias = tuple[int, float, str, str, int | None, Any]
"""An envelope as the appender keeps it: (seq, time, src, dst, cause, event). Building the
tuple costs the Trio thread a small fraction of building an `Envelope`, which is made when the
log is read."""


def correlation_of(event: Any) -> int | None:
    corr = getattr(event, "corr", None)
    if corr is None and hasattr(event, "request"):
        corr = getattr(event.request, "corr", None)
    return corr


@frozen(kw_only=True)
class Envelope:
    """One delivery: who sent what to whom, when, which request it belongs to, and which
    delivery caused it."""

    seq: int
    time: float
    src: str
    dst: str
    corr: int | None
    event: Any
    cause: int | None = None
    """The seq of the delivery its sender was handling (None: it started from outside, e.g. a
    client, a timer or the data plane)."""

    @classmethod
    def from_row(cls, row: Row) -> Envelope:
        seq, time, src, dst, cause, event = row
        corr = correlation_of(event)
        return cls(seq=seq, time=time, src=src, dst=dst, corr=corr, event=event, cause=cause)

    def to_json(self) -> str:
        return _line(self.seq, self.time, self.src, self.dst, self.corr, self.cause, self.event)

    @classmethod
    def from_json(cls, line: str) -> Envelope:
        return cls.from_record(json.loads(line))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Envelope:
        return cls(
            seq=record["seq"],
            time=record["time"],
            src=record["src"],
            dst=record["dst"],
            corr=record["corr"],
            event=codec.decode(record["event"]),
            cause=record.get("cause"),
        )


def row_json(row: Row) -> str:
    """The JSON line of the envelope `row` stands for (what `Envelope.to_json` writes)."""
    seq, time, src, dst, cause, event = row
    return _line(seq, time, src, dst, correlation_of(event), cause, event)


def _line(
    seq: int, time: float, src: str, dst: str, corr: int | None, cause: int | None, event: Any
) -> str:
    encoded = codec.encode(event)
    raw = encoded.pop("calls") if type(event) is HostCallsRecorded else None
    record = {
        "seq": seq,
        "time": time,
        "src": src,
        "dst": dst,
        "corr": corr,
        "cause": cause,
        "event": encoded,
    }
    line = ENCODER.encode(record)
    if raw is None:
        return line
    # Recorded calls are JSON text already: spliced in as the array they are, not escaped as
    # a string (a quarter of the bytes and none of the escaping). The event is the record's
    # last key, so the line ends with the two braces that close it and the record.
    return f'{line[:-2]},"calls":{raw}}}}}'


@frozen(kw_only=True)
class Gap:
    """Records `first` to `last` (their seq, inclusive) that are not in the file, and why."""

    first: int
    last: int
    reason: str

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    def to_json(self) -> str:
        return ENCODER.encode(
            {"gap": {"first": self.first, "last": self.last, "reason": self.reason}}
        )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Gap:
        gap = record["gap"]
        return cls(first=gap["first"], last=gap["last"], reason=gap["reason"])
