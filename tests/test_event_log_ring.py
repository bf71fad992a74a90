"""The ring keeps events packed as tuples the garbage collector stops walking, and gives them
back equal."""

from __future__ import annotations

import gc

import pytest

from pie.eventlog import EventLog
from pie.eventlog.packed import pack, unpack
from pie.events.sampling import TokenOutput
from pie.events.speculation import LanePassApplied, LanePassesApplied
from tests.test_events_codec import SAMPLES

pytestmark = pytest.mark.unit


def _pass(n: int) -> LanePassesApplied:
    lane = LanePassApplied(
        lease=1, context=2, corr=n, token=n, position=n, page=3, staged=True,
        outputs=(TokenOutput(token=n + 1),),
    )  # fmt: skip
    return LanePassesApplied(passes=(lane,) * 16)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_comes_back_from_the_ring_equal(event: object) -> None:
    back = unpack(pack(event))
    assert back == event and type(back) is type(event)


def test_a_full_ring_leaves_the_collector_nothing_to_walk() -> None:
    log = EventLog(ring_size=2_000)
    gc.collect()
    before = len(gc.get_objects())
    for n in range(2_000):
        log.append("inference", "kv", _pass(n))
    for _ in range(6):  # each pass untracks one more level of the nested tuples
        gc.collect()
    # Unpacked, these 2,000 passes would be about 100,000 objects for every full collection.
    assert len(gc.get_objects()) - before < 100
    assert [e.event for e in log.records()[-2:]] == [_pass(1_998), _pass(1_999)]
    assert log.rows_after(1_999)[0][5] == _pass(1_999)


def test_an_event_that_is_not_an_attrs_class_is_kept_as_it_is() -> None:
    log = EventLog()
    log.append("a", "b", ("plain", 1))
    assert log.records()[0].event == ("plain", 1)


def test_rows_of_other_kinds_are_passed_over() -> None:
    log = EventLog()
    log.append("a", "b", ("plain", 1))
    log.append("inference", "kv", _pass(7))
    rows = log.rows_after(0, (LanePassesApplied,))
    assert [(row[0], row[5]) for row in rows] == [(2, _pass(7))]
    assert log.oldest_held == 1
