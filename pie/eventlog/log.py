"""The append-only log of every delivered event: an in-memory ring and an optional
JSON-lines file."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from attrs import frozen

from pie.events import codec


@frozen(kw_only=True)
class Envelope:
    """One delivery: who sent what to whom, when, and which request it belongs to."""

    seq: int
    time: float
    src: str
    dst: str
    corr: int | None
    event: Any

    def to_json(self) -> str:
        record = {
            "seq": self.seq,
            "time": self.time,
            "src": self.src,
            "dst": self.dst,
            "corr": self.corr,
            "event": codec.encode(self.event),
        }
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Envelope:
        record = json.loads(line)
        return cls(
            seq=record["seq"],
            time=record["time"],
            src=record["src"],
            dst=record["dst"],
            corr=record["corr"],
            event=codec.decode(record["event"]),
        )


def correlation_of(event: Any) -> int | None:
    corr = getattr(event, "corr", None)
    if corr is None and hasattr(event, "request"):
        corr = getattr(event.request, "corr", None)
    return corr


class EventLog:
    """Keeps the last `ring_size` envelopes in memory and, with a path, every one on disk."""

    def __init__(self, *, ring_size: int = 100_000, path: str | Path | None = None) -> None:
        self._ring: collections.deque[Envelope] = collections.deque(maxlen=ring_size or None)
        self._seq = 0
        # One file per engine run: sequence numbers start at 1 and replay reads one history.
        self._file: IO[str] | None = open(path, "w", encoding="utf-8") if path else None
        self.path = Path(path) if path else None

    def append(self, src: str, dst: str, event: Any) -> Envelope:
        self._seq += 1
        envelope = Envelope(
            seq=self._seq,
            time=time.time(),
            src=src,
            dst=dst,
            corr=correlation_of(event),
            event=event,
        )
        self._ring.append(envelope)
        if self._file is not None:
            self._file.write(envelope.to_json() + "\n")
        return envelope

    def records(self) -> list[Envelope]:
        return list(self._ring)

    def __len__(self) -> int:
        return len(self._ring)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_log(path: str | Path) -> Iterator[Envelope]:
    """The envelopes of a JSON-lines log file, in order.

    A torn last line (the writer stopped mid-line) is skipped; a bad line anywhere else is an
    error, since everything after it would be silently lost.
    """
    with open(path, encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    for number, line in enumerate(lines, start=1):
        try:
            yield Envelope.from_json(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not line.endswith("\n"):
                return
            raise ValueError(f"{path}: line {number} is not a log record: {exc}") from exc
