"""The log file's encoder process: it writes what the writer thread would, for every event class
and for events whose payload the ring clips; an event it cannot take becomes a gap; an encoder
process that dies is reported, the ring goes on, and the file says what it lacks."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from pie.eventlog import EventLog, Gap, LogGap, read_entries, read_log
from pie.events import kv
from pie.events.inferlet import SessionInput
from pie.events.recording import HostCallsRecorded
from tests.test_events_codec import SAMPLES

pytestmark = pytest.mark.unit


def _lines_without_time(path: Path) -> list[dict[str, Any]]:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        record.pop("time", None)
        lines.append(record)
    return lines


def _write(path: Path, encoder: str, events: list[Any]) -> EventLog:
    log = EventLog(path=path, encoder=encoder, ring_payload=16)
    for n, event in enumerate(events):
        log.append("a", "b", event, cause=n or None)
    log.close()
    return log


def test_the_encoder_process_writes_every_event_as_the_writer_thread_does(tmp_path: Path) -> None:
    calls = json.dumps([["model.info", [], {"record": {"name": "m" * 100}}]], separators=(",", ":"))
    long = [
        SessionInput(instance="i1", text="x" * 1000, data=None),
        SessionInput(instance="i1", text=None, data=bytes(range(256)) * 4),
        HostCallsRecorded(instance="i1", first=0, calls=calls),
    ]
    events = [*SAMPLES, *long] * 3
    by_process = _write(tmp_path / "process.jsonl", "process", events)
    _write(tmp_path / "thread.jsonl", "thread", events)
    written = _lines_without_time(tmp_path / "process.jsonl")
    assert written == _lines_without_time(tmp_path / "thread.jsonl")
    assert [e.event for e in read_log(tmp_path / "process.jsonl")] == events
    stats = by_process.statistics().file
    assert stats is not None and (stats.written, stats.dropped, stats.error) == (
        len(events),
        0,
        None,
    )
    # The ring clipped the long payloads; the file has them whole.
    assert by_process.records()[-1].event != long[-1]


def test_an_event_the_encoder_process_cannot_take_becomes_a_gap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path)
    with caplog.at_level(logging.ERROR, logger="pie.eventlog.writer"):
        log.append("a", "kv", kv.CreateContext(corr=1, requester="a"))
        log.append("a", "kv", threading.Lock())  # cannot be pickled
        log.append("a", "kv", object())  # pickled, but has no encoding
        log.append("a", "kv", kv.CreateContext(corr=4, requester="a"))
        log.close()
    entries = list(read_entries(path))
    assert [type(e).__name__ for e in entries] == ["Envelope", "Gap", "Gap", "Envelope"]
    assert [(e.first, e.last) for e in entries if isinstance(e, Gap)] == [(2, 2), (3, 3)]
    assert all("could not encode" in e.reason for e in entries if isinstance(e, Gap))
    assert "seq 2 could not encode" in caplog.text and "seq 3 could not encode" in caplog.text
    stats = log.statistics().file
    assert stats is not None and (stats.written, stats.dropped) == (2, 2)


def test_an_encoder_process_that_dies_is_reported_and_the_file_marks_what_it_lacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path)
    for corr in range(1, 4):
        log.append("a", "kv", kv.CreateContext(corr=corr, requester="a"))
    assert log.flush(timeout=10)
    writer = log._file
    assert writer is not None
    child = writer._sink._child  # type: ignore[union-attr]
    child.kill()
    child.wait()
    with caplog.at_level(logging.ERROR, logger="pie.eventlog.writer"):
        for corr in range(4, 9):
            log.append("a", "kv", kv.CreateContext(corr=corr, requester="a"))
        assert log.flush(timeout=10)
    assert "encoder process stopped" in caplog.text
    stats = log.statistics().file
    assert stats is not None and stats.error is not None
    assert "encoder process stopped" in stats.error
    assert (stats.written, stats.dropped) == (3, 5)
    log.close()
    assert len(log.records()) == 8  # the ring has every record
    with pytest.raises(LogGap, match="seq 4 to 8\\) are not in the file: writing failed"):
        list(read_log(path))


def test_an_encoder_process_that_cannot_start_leaves_the_writer_thread_encoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr("pie.eventlog.encoder.subprocess.Popen", refuse)
    path = tmp_path / "events.jsonl"
    with caplog.at_level(logging.WARNING, logger="pie.eventlog.log"):
        log = EventLog(path=path)
    assert "encoder process could not start" in caplog.text
    log.append("a", "kv", kv.CreateContext(corr=1, requester="a"))
    log.close()
    assert [e.event for e in read_log(path)] == [kv.CreateContext(corr=1, requester="a")]
