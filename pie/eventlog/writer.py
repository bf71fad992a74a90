"""The event log's file writer: one thread that hands rows, in the order they were handed over
and a batch at a time, to a sink that encodes them and appends them to the file (in a child
process, or on this thread: pie/eventlog/encoder.py), so the appender only passes references.

When the writer falls behind by `max_pending` records, records are left out of the file (they
stay in the ring) until it has caught up by half, and the file says so with one gap record: a
log read for replay never has a silent hole.
"""

from __future__ import annotations

import collections
import logging
import threading

from attrs import frozen

from pie.eventlog.encoder import ProcessSink, SinkFailed, ThreadSink
from pie.eventlog.records import Gap, Row

log = logging.getLogger(__name__)

BATCH_RECORDS = 128
"""The most records encoded per write."""

LINGER_SECONDS = 0.05
"""How long the writer, woken by a record, waits for more before it writes: records arriving
together share a write, and the Trio thread wakes the writer once per quiet spell rather than
once per record. A full batch, `flush` and `close` cut it short."""


@frozen(kw_only=True)
class WriterStatistics:
    written: int
    """Records in the file."""
    dropped: int
    """Records left out of the file (each stretch is marked by a gap record)."""
    pending: int
    """Records handed over and not yet written."""
    error: str | None
    """Why the file stopped taking records, if it did."""


class _Flush:
    """A marker in the queue, set once everything handed over before it is in the file."""

    def __init__(self) -> None:
        self.done = threading.Event()


class FileWriter:
    """Writes records through `sink` from its own thread. `submit` is called from one thread
    only (the Trio thread); it never blocks. A sink that is `packed` takes rows whose event is
    packed (pie/eventlog/packed.py)."""

    def __init__(self, sink: ThreadSink | ProcessSink, *, max_pending: int, name: str) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._sink = sink
        self.packed = sink.packed
        self._name = name
        self._max_pending = max_pending
        self._queue: collections.deque[Row | Gap | _Flush] = collections.deque()
        self._wake = threading.Event()
        self._idle = False
        self._closing = False
        self._hurry = False
        """A flush is waiting: no lingering until its marker is written."""
        self._dropping: Gap | None = None
        self._written = 0
        self._dropped = 0
        self._unwritten: Gap | None = None
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="pie-event-log", daemon=True)
        self._thread.start()

    def submit(self, row: Row) -> None:
        """Queues `row` for the file, or counts it as dropped while the writer is behind."""
        if self._dropping is not None or len(self._queue) >= self._max_pending:
            if not self._drop(row[0]):
                return
        self._queue.append(row)
        if self._idle or len(self._queue) == BATCH_RECORDS:
            self._wake.set()

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every record submitted so far is in the file (or was dropped there);
        False if `timeout` passed first. Blocks: call it off the Trio thread, or at shutdown."""
        if self._closing:
            return not self._thread.is_alive()
        marker = _Flush()
        self._hurry = True
        self._queue.append(marker)
        self._wake.set()
        return marker.done.wait(timeout)

    def close(self) -> None:
        """Writes everything still queued, then closes the file and ends the thread."""
        if self._closing:
            return
        if self._dropping is not None:
            self._queue.append(self._dropping)
            self._dropping = None
        self._closing = True
        self._wake.set()
        self._thread.join()

    def statistics(self) -> WriterStatistics:
        return WriterStatistics(
            written=self._written,
            dropped=self._dropped,
            pending=len(self._queue),
            error=self._error,
        )

    def _drop(self, seq: int) -> bool:
        """While behind, counts record `seq` as dropped and returns False; once caught up,
        queues the gap record and returns True."""
        dropping = self._dropping
        if dropping is None:
            reason = f"the writer fell behind by {self._max_pending} records"
            self._dropping = Gap(first=seq, last=seq, reason=reason)
            log.warning(
                "event log %s: %s; records from seq %d are left out of the file until it "
                "catches up (the file marks the gap)",
                self._name,
                reason,
                seq,
            )
        elif len(self._queue) > self._max_pending // 2:
            self._dropping = Gap(first=dropping.first, last=seq, reason=dropping.reason)
        else:
            self._queue.append(dropping)
            self._dropping = None
            return True
        self._dropped += 1
        return False

    def _run(self) -> None:
        while self._wait():
            while batch := self._take():
                self._write(batch)
        self._finish()

    def _wait(self) -> bool:
        """Waits for records, then lingers for a batch; False once closing with none left."""
        queue = self._queue
        if not queue:
            self._idle = True
            self._wake.clear()
            # Checked again after announcing idleness: a record queued before it is seen here,
            # one queued after it sets the event.
            if not queue and not self._closing:
                self._wake.wait()
            self._idle = False
        if self._may_linger():
            self._wake.clear()
            if self._may_linger():
                self._wake.wait(LINGER_SECONDS)
        return bool(queue) or not self._closing

    def _may_linger(self) -> bool:
        return len(self._queue) < BATCH_RECORDS and not self._closing and not self._hurry

    def _take(self) -> list[Row | Gap | _Flush]:
        queue = self._queue
        return [queue.popleft() for _ in range(min(len(queue), BATCH_RECORDS))]

    def _write(self, batch: list[Row | Gap | _Flush]) -> None:
        items = [item for item in batch if not isinstance(item, _Flush)]
        if items and self._error is None:
            self._append(items)
        if items and self._error is not None:
            self._skip(items)
        for item in batch:
            if isinstance(item, _Flush):
                self._hurry = False
                item.done.set()

    def _append(self, items: list[Row | Gap]) -> None:
        """One write for the batch; a record that cannot be encoded becomes a gap."""
        try:
            written = self._sink.write(items)
        except SinkFailed as exc:
            self._fail(str(exc))
            return
        for seq, reason in written.unencodable:
            # A bug in an event's codec: that record became a gap, the others are written.
            log.error("event log %s: seq %d %s", self._name, seq, reason)
        self._written += written.encoded
        self._dropped += sum(not isinstance(item, Gap) for item in items) - written.encoded

    def _fail(self, error: str) -> None:
        self._error = error
        log.error(
            "event log %s: writing failed (%s); records from here on are kept in memory only",
            self._name,
            self._error,
        )

    def _skip(self, items: list[Row | Gap]) -> None:
        """Adds records the failed file never got to the stretch reported at close."""
        first = min(item.first if isinstance(item, Gap) else item[0] for item in items)
        last = max(item.last if isinstance(item, Gap) else item[0] for item in items)
        if self._unwritten is not None:
            first = self._unwritten.first
        self._unwritten = Gap(first=first, last=last, reason=f"writing failed: {self._error}")
        # Gaps queued by `_drop` were counted when their records were dropped.
        self._dropped += sum(not isinstance(item, Gap) for item in items)

    def _finish(self) -> None:
        """Marks the stretch a failed write left out, if the file takes it, and closes."""
        try:
            self._sink.close(self._unwritten)
        except Exception as exc:
            if self._error is None:
                self._fail(
                    str(exc) if isinstance(exc, SinkFailed) else f"{type(exc).__name__}: {exc}"
                )
