"""The event log's file, written by its own thread (through the encoder process, or on that thread
for a file object): records land in seq order and all of them by close; a writer that falls
behind leaves a marked gap that replay refuses; a writer that fails is reported and the engine
carries on."""

from __future__ import annotations

import argparse
import errno
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.cli.log import run_log, run_replay
from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import open_engine
from pie.eventlog import EventLog, Gap, LogGap, read_entries, read_log
from pie.eventlog.tree import causal_tree
from pie.events import bus, http, kv
from pie.events.batching import EngineStarted
from pie.events.sampling import Argmax, SamplingSlot


def greedy_at(index: int) -> tuple[SamplingSlot, ...]:
    return (SamplingSlot(index=index, op=Argmax()),)


def created(corr: int) -> kv.CreateContext:
    return kv.CreateContext(corr=corr, requester="a")


class GatedFile:
    """A log file whose writes wait for `gate`, announcing each one on `entered`."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "w", encoding="utf-8")
        self.entered = threading.Event()
        self.gate = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        self.gate.wait()
        return self._file.write(text)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class FailingFile:
    """A log file on a disk that fills up: writes after the first `good` ones raise ENOSPC,
    until `recover` is set."""

    def __init__(self, path: Path, good: int) -> None:
        self._file = open(path, "w", encoding="utf-8")
        self._good = good
        self.recover = threading.Event()

    def write(self, text: str) -> int:
        if self._good <= 0 and not self.recover.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        self._good -= 1
        return self._file.write(text)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def blocked_log(path: Path, bound: int) -> tuple[EventLog, GatedFile]:
    """A log whose writer has taken record 1 and is stuck writing it."""
    file = GatedFile(path)
    log = EventLog(path=path, file=file, max_unwritten=bound)  # type: ignore[arg-type]
    log.append("a", "kv", created(1))
    assert file.entered.wait(5)
    return log, file


@pytest.mark.unit
async def test_records_appended_on_the_trio_thread_land_in_the_file_in_seq_order(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path)
    for corr in range(1, 5001):
        log.append("a", "kv", created(corr))
        log.append("kv", "a", kv.ContextCreated(corr=corr, context=corr))
        if corr % 100 == 0:
            await trio.sleep(0)  # let the writer take what is queued while appends go on
    log.close()
    on_disk = list(read_log(path))
    assert [e.seq for e in on_disk] == list(range(1, 10001))
    assert on_disk == log.records()


@pytest.mark.unit
def test_the_file_is_complete_once_the_log_is_closed(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path)
    for corr in range(1, 301):
        log.append("a", "kv", created(corr))
    log.close()
    assert [e.event for e in read_log(path)] == [e.event for e in log.records()]
    stats = log.statistics().file
    assert stats is not None
    assert (stats.written, stats.dropped, stats.pending, stats.error) == (300, 0, 0, None)


@pytest.mark.unit
def test_flush_waits_until_everything_appended_is_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log, file = blocked_log(path, bound=100)
    log.append("a", "kv", created(2))
    assert not log.flush(timeout=0.05)
    file.gate.set()
    assert log.flush(timeout=5)
    assert [e.seq for e in read_log(path)] == [1, 2]
    log.close()


@pytest.mark.unit
def test_a_writer_behind_by_the_bound_leaves_a_marked_gap(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log, file = blocked_log(path, bound=4)
    for corr in range(2, 11):  # 2-5 wait in the queue; 6-10 find it full and are left out
        log.append("a", "kv", created(corr))
    stats = log.statistics().file
    assert stats is not None and (stats.pending, stats.dropped) == (4, 5)
    file.gate.set()
    assert log.flush(timeout=5)
    log.append("a", "kv", created(11))  # caught up: the gap is marked, then 11 is written
    log.close()
    entries = list(read_entries(path))
    assert [e.seq for e in entries if not isinstance(e, Gap)] == [1, 2, 3, 4, 5, 11]
    gaps = [e for e in entries if isinstance(e, Gap)]
    assert [(g.first, g.last) for g in gaps] == [(6, 10)]
    assert "fell behind by 4 records" in gaps[0].reason
    assert len(log.records()) == 11  # the ring keeps everything
    with pytest.raises(LogGap, match="5 records \\(seq 6 to 10\\)"):
        list(read_log(path))


@pytest.mark.unit
def test_a_gap_still_open_at_close_is_marked(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log, file = blocked_log(path, bound=1)
    for corr in range(2, 5):
        log.append("a", "kv", created(corr))
    file.gate.set()
    log.close()
    gaps = [e for e in read_entries(path) if isinstance(e, Gap)]
    assert [(g.first, g.last) for g in gaps] == [(3, 4)]


@pytest.mark.unit
def test_replay_refuses_a_log_with_a_gap_and_pie_log_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "events.jsonl"
    log, file = blocked_log(path, bound=1)
    started = EngineStarted(
        model="m", vocab_size=10, page_size=4, num_pages=8, max_batch_tokens=8, max_batch_requests=2
    )
    log.append("engine", "engine", started)
    for corr in range(3, 6):
        log.append("a", "kv", created(corr))
    file.gate.set()
    log.close()
    assert run_replay(argparse.Namespace(file=path, actor="kv", inferlet=None)) == 2
    assert "cannot replay an incomplete log" in capsys.readouterr().err
    assert run_log(argparse.Namespace(file=path, actor=None, corr=None, limit=0, tree=None)) == 0
    assert "records not in the file (seq 3 to 5)" in capsys.readouterr().out


@pytest.mark.unit
def test_a_hole_in_the_sequence_is_a_gap_even_without_a_gap_record(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path)
    for corr in range(1, 4):
        log.append("a", "kv", created(corr))
    log.close()
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text(lines[0] + lines[2], encoding="utf-8")
    with pytest.raises(LogGap, match="seq 2 to 2\\) are not in the file: missing"):
        list(read_log(path))


@pytest.mark.unit
def test_a_failing_disk_is_reported_and_appends_carry_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "events.jsonl"
    file = FailingFile(path, good=1)
    log = EventLog(path=path, file=file)  # type: ignore[arg-type]
    log.append("a", "kv", created(1))
    assert log.flush(timeout=5)
    with caplog.at_level(logging.ERROR, logger="pie.eventlog.writer"):
        for corr in range(2, 6):
            log.append("a", "kv", created(corr))
        assert log.flush(timeout=5)
    assert "No space left on device" in caplog.text
    stats = log.statistics().file
    assert stats is not None
    assert stats.written == 1 and stats.dropped == 4
    assert stats.error is not None and "No space left" in stats.error
    file.recover.set()  # space again by the time the engine stops: the file says what it lacks
    log.close()
    assert len(log.records()) == 5
    with pytest.raises(LogGap, match="seq 2 to 5\\) are not in the file: writing failed"):
        list(read_log(path))


@pytest.mark.unit
def test_a_record_that_cannot_be_encoded_becomes_a_gap(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path)
    log.append("a", "kv", created(1))
    log.append("a", "kv", object())
    log.append("a", "kv", created(3))
    log.close()
    entries = list(read_entries(path))
    assert [type(e).__name__ for e in entries] == ["Envelope", "Gap", "Envelope"]
    gap = entries[1]
    assert isinstance(gap, Gap) and gap.first == gap.last == 2
    assert "could not encode" in gap.reason


@pytest.mark.integration
async def test_an_engine_whose_log_file_fails_keeps_serving(tmp_path: Path) -> None:
    full = Path("/dev/full")
    if not full.exists():
        pytest.skip("needs /dev/full")
    config = with_overrides(EngineConfig(), event_log={"path": str(full)})
    with trio.fail_after(10):
        async with open_engine(config, driver=SyntheticDriver()) as engine:
            async with engine.requester() as r:
                context = await r.create_context()
                outputs: Any = await r.forward(context, [1, 2])
    assert outputs is not None
    assert engine.log is not None
    statistics = engine.log.statistics()
    stats = statistics.file
    assert stats is not None and stats.error is not None and "No space left" in stats.error
    assert stats.written == 0 and stats.dropped == statistics.appended


@pytest.mark.unit
def test_the_ring_keeps_a_prefix_of_a_long_payload_and_the_file_keeps_it_whole(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path, ring_payload=8)
    whole = bus.Push(corr=1, requester="a", queue="q", message="x" * 10_000, user="u")
    short = bus.Push(corr=2, requester="a", queue="q", message="12345678", user="u")
    fetched = http.HttpFetched(
        corr=3, status=200, url="http://a/", headers=(("k", "v"),), body=b"y" * 100
    )
    for event in (whole, short, fetched):
        log.append("a", "bus", event)
    log.close()
    kept = [e.event for e in log.records()]
    assert kept[0].message == "xxxxxxxx... [10000 in all; the ring keeps 8]"
    assert (kept[0].queue, kept[0].user) == ("q", "u")
    assert kept[1] == short
    assert kept[2].body == b"yyyyyyyy... [100 in all; the ring keeps 8]"
    assert kept[2].headers == fetched.headers
    assert [e.event for e in read_log(path)] == [whole, short, fetched]


@pytest.mark.unit
def test_a_ring_payload_of_zero_keeps_events_whole() -> None:
    log = EventLog(ring_payload=0)
    event = bus.Publish(corr=1, requester="a", topic="t", message="m" * 10_000)
    log.append("a", "bus", event)
    assert log.records()[0].event == event


@pytest.mark.unit
def test_by_default_the_ring_holds_little_of_a_million_character_message() -> None:
    log = EventLog()
    for corr in range(20):
        log.append(
            "a", "bus", bus.Publish(corr=corr, requester="a", topic="t", message="m" * 2**20)
        )
    assert sum(len(e.event.message) for e in log.records()) < 20 * 512


@pytest.mark.integration
async def test_each_delivery_names_its_cause_down_to_the_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "events.jsonl"
    config = with_overrides(EngineConfig(), event_log={"path": str(path)})
    with trio.fail_after(10):
        async with open_engine(config, driver=SyntheticDriver()) as engine:
            async with engine.requester() as r:
                context = await r.create_context()
                out = await r.forward(context, [5, 6, 7], greedy_at(2))
                await r.forward(context, [out[0].token], greedy_at(0))  # type: ignore[union-attr]
    envelopes = list(read_log(path))
    by_type: dict[str, list[Any]] = {}
    for env in envelopes:
        by_type.setdefault(type(env.event).__name__, []).append(env)
    create, created = by_type["CreateContext"][0], by_type["ContextCreated"][0]
    submits, placed = by_type["SubmitForward"], by_type["ScheduleForward"]
    completed, applied = by_type["ForwardCompleted"], by_type["PassApplied"]
    assert created.cause == create.seq
    assert submits[0].cause == created.seq  # the requester acted on what it had received
    assert [p.cause for p in placed] == [s.seq for s in submits]
    assert [c.cause for c in completed] == [p.seq for p in placed] == [a.cause for a in applied]
    assert submits[1].cause == completed[0].seq

    tree = list(causal_tree(envelopes, create.seq))
    assert tree[0] == (0, create)
    assert {env.seq for _, env in tree} >= {e.seq for e in (*submits, *placed, *completed)}
    assert [depth for depth, env in tree if env in completed] == [4, 7]

    args = argparse.Namespace(
        file=str(path), actor=None, corr=None, limit=0, tree=completed[1].seq, root=True
    )
    assert run_log(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"[0] {create.seq:>7}") and "CreateContext" in lines[0]
    assert any(line.startswith("        [4] ") and "ForwardCompleted" in line for line in lines)
    assert run_log(argparse.Namespace(**{**vars(args), "tree": 10**6, "root": False})) == 2
