"""The append-only log of every delivered event: an in-memory ring and an optional
JSON-lines file, written by its own thread (pie/eventlog/writer.py)."""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from attrs import frozen

from pie.eventlog.clip import clip
from pie.eventlog.encoder import ProcessSink, ThreadSink
from pie.eventlog.packed import pack, packed_kind, unpack
from pie.eventlog.records import Envelope, Gap, Row
from pie.eventlog.writer import FileWriter, WriterStatistics

__all__ = ["Envelope", "EventLog", "EventLogStatistics", "LogGap", "read_entries", "read_log"]

log = logging.getLogger(__name__)

ENCODERS = ("process", "thread")
"""Where a log file's records are encoded ([event_log] encoder)."""


class LogGap(ValueError):
    """A log file that lacks records, so it cannot be replayed: the text says which and why."""


@frozen(kw_only=True)
class EventLogStatistics:
    appended: int
    """Envelopes appended (the last seq)."""
    in_memory: int
    file: WriterStatistics | None
    """The file writer's counts; None without a file."""


class EventLog:
    """Keeps the last `ring_size` envelopes in memory and, with a path, every one on disk.

    The ring keeps each event packed as nested tuples (pie/eventlog/packed.py), which the
    garbage collector stops walking; reading it unpacks them.

    `append` is called from one thread (the Trio thread) and only numbers the envelope, keeps
    it and hands it to the file writer; the writer thread has it encoded and written in seq
    order, leaving out (and marking as a gap) what arrives while it is `max_unwritten` records
    behind. With `path`, a child process encodes and writes (`encoder="process"`, taking each
    event as the ring packs it), or the writer thread itself (`"thread"`).
    The ring keeps each text or bytes field of an event only up to `ring_payload` characters
    (0: in full); the file gets the whole event.
    `file`, instead of `path`, is an open text file to write (closed with the log), by the
    writer thread.
    """

    def __init__(
        self,
        *,
        ring_size: int = 100_000,
        path: str | Path | None = None,
        max_unwritten: int = 100_000,
        file: IO[str] | None = None,
        ring_payload: int = 256,
        encoder: str = "process",
    ) -> None:
        if encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {', '.join(ENCODERS)}, got {encoder!r}")
        self.ring_payload = ring_payload
        self._ring: collections.deque[Row] = collections.deque(maxlen=ring_size or None)
        self._seq = 0
        self.path = Path(path) if path else None
        sink: ThreadSink | ProcessSink | None = None
        if file is not None:
            sink = ThreadSink(file)
        elif path:
            # One file per engine run: sequence numbers start at 1 and replay reads one history.
            sink = _sink_for(open(path, "w", encoding="utf-8"), str(path), encoder)
        self._file = (
            FileWriter(sink, max_pending=max_unwritten, name=str(path or file))
            if sink is not None
            else None
        )
        self._writer = self._file
        """The file writer while it takes records: None once closed."""
        self._listeners: tuple[Callable[[Row], None], ...] = ()

    def append(self, src: str, dst: str, event: Any, cause: int | None = None) -> int:
        """Records a delivery, and the seq of the delivery that caused it; returns its seq."""
        self._seq += 1
        now = time.time()
        row = (self._seq, now, src, dst, cause, event)
        kept = clip(event, self.ring_payload) if self.ring_payload else event
        packed = pack(kept)
        self._ring.append((self._seq, now, src, dst, cause, packed))
        writer = self._writer
        if writer is not None:
            if writer.packed:
                packed = packed if kept is event else pack(event)
                writer.submit((self._seq, now, src, dst, cause, packed))
            else:
                writer.submit(row)
        if self._listeners:
            self._tell(row if kept is event else (self._seq, now, src, dst, cause, kept))
        return self._seq

    @property
    def next_seq(self) -> int:
        """The seq the next `append` will take."""
        return self._seq + 1

    # -- listeners ---------------------------------------------------------------------------

    def listen(self, listener: Callable[[Row], None]) -> Callable[[], None]:
        """Calls `listener(row)` with every later envelope as the ring keeps it, on the appending
        (Trio) thread: it must be quick and must not block. Returns what stops it; a listener
        that raises is logged and stopped."""
        self._listeners = (*self._listeners, listener)

        def stop() -> None:
            self._listeners = tuple(f for f in self._listeners if f is not listener)

        return stop

    def _tell(self, row: Row) -> None:
        for listener in self._listeners:
            try:
                listener(row)
            except Exception:  # a broken listener must not fail the delivery it heard of
                log.exception("an event log listener failed; it hears no more")
                self._listeners = tuple(f for f in self._listeners if f is not listener)

    def records(self) -> list[Envelope]:
        """The envelopes in the ring, oldest first."""
        return [Envelope.from_row(_unpacked(row)) for row in self._ring]

    def rows_after(self, seq: int, kinds: tuple[type, ...] | None = None) -> list[Row]:
        """The rows the ring holds that were appended after `seq`, oldest first (the ring is
        walked from its end, so only those are touched); with `kinds`, only those whose event
        is one of them (the others are passed over without being unpacked)."""
        rows: list[Row] = []
        for row in reversed(self._ring):
            if row[0] <= seq:
                break
            if kinds is None or packed_kind(row[5]) in kinds:
                rows.append(_unpacked(row))
        rows.reverse()
        return rows

    @property
    def oldest_held(self) -> int:
        """The seq of the oldest envelope the ring holds (`next_seq` when it holds none)."""
        return self._ring[0][0] if self._ring else self.next_seq

    def __len__(self) -> int:
        return len(self._ring)

    def statistics(self) -> EventLogStatistics:
        return EventLogStatistics(
            appended=self._seq,
            in_memory=len(self._ring),
            file=self._file.statistics() if self._file is not None else None,
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every envelope appended so far is in the file; False if `timeout`
        passed first. Blocks the calling thread."""
        return self._writer.flush(timeout) if self._writer is not None else True

    def close(self) -> None:
        """Writes what is still queued and closes the file (waiting for the writer); the ring
        stays readable and later appends are kept in memory only. A failed writer does not
        raise here: its error is in `statistics()` and was logged when it happened."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _sink_for(file: IO[str], path: str, encoder: str) -> ThreadSink | ProcessSink:
    """The encoder process for `file`, or the writer thread when asked or when the process
    cannot be started (which is logged)."""
    if encoder == "process":
        try:
            return ProcessSink(file, path)
        except OSError as exc:
            log.warning(
                "event log %s: the encoder process could not start (%s); the writer thread "
                "encodes instead",
                path,
                exc,
            )
    return ThreadSink(file)


def _unpacked(row: Row) -> Row:
    seq, time, src, dst, cause, packed = row
    return (seq, time, src, dst, cause, unpack(packed))


def read_entries(path: str | Path) -> Iterator[Envelope | Gap]:
    """The envelopes of a JSON-lines log file and the gaps between them, in order: the gap
    records the writer left, and a `Gap` for any other hole in the sequence numbers.

    A torn last line (the writer stopped mid-line) is skipped; a bad line anywhere else is an
    error, since everything after it would be silently lost.
    """
    with open(path, encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    expected = 1
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not line.endswith("\n"):
                return
            raise ValueError(f"{path}: line {number} is not a log record: {exc}") from exc
        entry = Gap.from_record(record) if "gap" in record else Envelope.from_record(record)
        first = entry.first if isinstance(entry, Gap) else entry.seq
        if first < expected:
            raise ValueError(f"{path}: line {number} repeats or reorders seq {first}")
        if first > expected:
            yield Gap(first=expected, last=first - 1, reason="missing from the file")
        yield entry
        expected = (entry.last if isinstance(entry, Gap) else entry.seq) + 1


def read_log(path: str | Path) -> Iterator[Envelope]:
    """The envelopes of a JSON-lines log file, in order; `LogGap` where records are missing,
    so that a replay never reads a log with holes."""
    for entry in read_entries(path):
        if isinstance(entry, Gap):
            raise LogGap(
                f"{path}: {entry.count} records (seq {entry.first} to {entry.last}) are not in "
                f"the file: {entry.reason}"
            )
        yield entry
