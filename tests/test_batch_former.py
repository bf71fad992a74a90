"""The batch former with time passed in: batch limits, chunked prefill, decodes before prefill
chunks, lanes first with room kept for queued work, the adaptive firing rule and its
statistics."""

from __future__ import annotations

from typing import Any

import pytest

from pie.dataplane.former import BatchFormer, BatchPolicy, BatchStatistics, FormedPass, LaneState
from pie.events.forward import ForwardRequest, PageCopy
from pie.events.sampling import Argmax, Entropy, SamplingSlot
from pie.events.speculation import Lease

pytestmark = pytest.mark.unit


def request(
    corr: int, length: int = 1, *, context: int | None = None, **fields: Any
) -> ForwardRequest:
    tokens = tuple(range(100 * corr, 100 * corr + length))
    return ForwardRequest(
        corr=corr,
        requester="a",
        context=corr if context is None else context,
        tokens=tokens,
        positions=tuple(range(length)),
        kv_start=0,
        pages=(corr,),
        **fields,
    )


def fire(core: BatchFormer, now: float = 0.0, seconds: float = 0.0) -> FormedPass:
    """The next batch, which must fire at `now`; the pass is then reported finished."""
    batch = core.next_batch(now)
    assert batch is not None
    core.pass_finished(seconds)
    return batch


def drain(core: BatchFormer) -> list[FormedPass]:
    batches = []
    while core.statistics().pending:
        batches.append(fire(core, now=1e9))
    return batches


def test_the_first_request_fires_at_once() -> None:
    core = BatchFormer(BatchPolicy())
    core.submit(request(1), now=5.0)
    batch = core.next_batch(5.0)
    assert batch is not None and [r.corr for r in batch.requests] == [1]


def test_an_empty_queue_fires_nothing() -> None:
    core = BatchFormer(BatchPolicy())
    assert core.next_batch(0.0) is None and core.deadline() is None


def test_batches_hold_at_most_max_batch_requests() -> None:
    core = BatchFormer(BatchPolicy(max_batch_requests=3))
    for corr in range(1, 8):
        core.submit(request(corr), now=0.0)
    sizes = [len(b.requests) for b in drain(core)]
    assert sizes == [3, 3, 1]


def test_batches_hold_at_most_max_batch_tokens_and_keep_every_token_in_order() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=10))
    for corr in range(1, 6):
        core.submit(request(corr, 4), now=0.0)
    batches = drain(core)
    assert all(sum(len(r.tokens) for r in b.requests) <= 10 for b in batches)
    sent = [t for b in batches for r in b.requests for t in r.tokens]
    assert sent == [t for corr in range(1, 6) for t in request(corr, 4).tokens]


def test_a_batch_holds_one_request_per_context() -> None:
    core = BatchFormer(BatchPolicy())
    core.submit(request(1, context=7), now=0.0)
    core.submit(request(2, context=7), now=0.0)
    core.submit(request(3, context=8), now=0.0)
    batches = drain(core)
    assert [[r.corr for r in b.requests] for b in batches] == [[1, 3], [2]]


def test_a_long_prefill_is_split_into_chunks_in_order() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=10))
    slots = (
        SamplingSlot(index=3, op=Argmax()),
        SamplingSlot(index=12, op=Entropy()),
        SamplingSlot(index=24, op=Argmax()),
    )
    masks = tuple((i + 1,) for i in range(25))
    long = request(1, 25, slots=slots, copies=(PageCopy(src=1, dst=2),), attention_masks=masks)
    core.submit(long, now=0.0)
    chunks = [b.requests[0] for b in drain(core)]
    pieces = [slice(0, 10), slice(10, 20), slice(20, 25)]
    assert [c.tokens for c in chunks] == [long.tokens[p] for p in pieces]
    assert [c.positions for c in chunks] == [long.positions[p] for p in pieces]
    assert [c.kv_start for c in chunks] == [0, 10, 20]
    assert [c.copies for c in chunks] == [long.copies, (), ()]
    assert [c.final for c in chunks] == [False, False, True]
    assert [c.slots for c in chunks] == [
        (slots[0],),
        (SamplingSlot(index=2, op=Entropy()),),
        (SamplingSlot(index=4, op=Argmax()),),
    ]
    assert [c.slot_positions for c in chunks] == [(0,), (1,), (2,)]
    assert chunks[1].attention_masks == masks[10:20]
    assert core.statistics().chunks == 2


def test_a_chunk_without_slots_carries_none() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=4))
    core.submit(request(1, 8, slots=(SamplingSlot(index=7, op=Argmax()),)), now=0.0)
    first, last = (b.requests[0] for b in drain(core))
    assert (first.slots, first.slot_positions) == ((), ())
    assert last.slots == (SamplingSlot(index=3, op=Argmax()),) and last.slot_positions == (0,)


def test_a_slot_on_a_chunk_boundary_goes_with_the_chunk_it_starts() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=4))
    core.submit(request(1, 8, slots=(SamplingSlot(index=4, op=Argmax()),)), now=0.0)
    first, last = (b.requests[0] for b in drain(core))
    assert (first.slots, first.slot_positions) == ((), ())
    assert last.slots == (SamplingSlot(index=0, op=Argmax()),) and last.slot_positions == (0,)


def test_chunks_continue_from_the_requests_kv_start() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=4))
    core.submit(
        ForwardRequest(
            corr=1,
            requester="a",
            context=1,
            tokens=tuple(range(6)),
            positions=tuple(range(9, 15)),
            kv_start=9,
            pages=(0, 1, 2, 3),
        ),
        now=0.0,
    )
    chunks = [b.requests[0] for b in drain(core)]
    assert [(c.kv_start, c.kv_len) for c in chunks] == [(9, 13), (13, 15)]


def test_decodes_go_before_a_long_prefill_which_takes_the_budget_they_leave() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=10, decode_tokens=2))
    core.submit(request(1, 2), now=0.0)
    core.submit(request(2, 25), now=0.0)
    core.submit(request(3, 2), now=0.0)
    orders = []
    for step in range(4):
        batch = fire(core, now=float(step))
        orders.append([(r.corr, len(r.tokens)) for r in batch.requests])
        core.submit(request(10 + step, 2), now=float(step))
    assert orders == [
        [(1, 2), (3, 2), (2, 6)],
        [(10, 2), (2, 8)],
        [(11, 2), (2, 8)],
        [(12, 2), (2, 3)],
    ]


def test_without_decode_first_a_prefill_would_hold_the_decodes_behind_it() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=8, decode_tokens=1))
    core.submit(request(1, 30), now=0.0)
    core.submit(request(2, 1), now=0.0)
    batch = fire(core)
    assert [(r.corr, len(r.tokens)) for r in batch.requests] == [(2, 1), (1, 7)]


def test_a_contexts_decode_never_overtakes_its_own_earlier_prefill() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=8))
    core.submit(request(1, 30, context=5), now=0.0)
    core.submit(request(2, 1, context=5), now=0.0)
    core.submit(request(3, 1, context=6), now=0.0)
    first = fire(core)
    assert [r.corr for r in first.requests] == [3, 1]
    corrs = [r.corr for b in drain(core) for r in b.requests]
    assert corrs.index(2) > max(i for i, c in enumerate(corrs) if c == 1)


def test_lane_passes_fill_the_pass_first_and_leave_room_for_queued_work() -> None:
    core = BatchFormer(BatchPolicy(max_batch_requests=4, max_batch_tokens=64))
    core.submit(request(1, 3), now=0.0)
    batch = core.next_batch(0.0, LaneState(ready=10))
    assert batch is not None and batch.lanes == 3 and [r.corr for r in batch.requests] == [1]


def test_lanes_alone_fire_a_pass_up_to_the_request_limit() -> None:
    core = BatchFormer(BatchPolicy(max_batch_requests=4))
    batch = core.next_batch(0.0, LaneState(ready=10))
    assert batch is not None and batch.lanes == 4 and batch.requests == ()
    core.pass_finished(0.5, now=1.0)
    stats = core.statistics()
    assert (stats.lane_passes, stats.requests, stats.tokens, stats.last_batch_size) == (4, 0, 4, 4)


def test_an_awaited_lane_holds_the_pass_until_the_watchdog() -> None:
    core = BatchFormer(BatchPolicy())
    assert core.next_batch(0.0, LaneState(ready=2)) is not None
    core.pass_finished(0.5, now=1.0)
    waiting = LaneState(ready=1, awaited=True)
    assert core.next_batch(1.2, waiting) is None
    assert core.deadline(waiting) == 1.5
    batch = core.next_batch(1.5, waiting)
    assert batch is not None and batch.lanes == 1


def test_an_awaited_lane_does_not_hold_a_pass_that_is_already_full() -> None:
    core = BatchFormer(BatchPolicy(max_batch_requests=3))
    assert core.next_batch(0.0, LaneState(ready=1)) is not None
    core.pass_finished(0.5, now=1.0)
    batch = core.next_batch(1.0, LaneState(ready=3, awaited=True))
    assert batch is not None and batch.lanes == 3


def test_dropping_a_request_forgets_its_remaining_chunks() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=4))
    core.submit(request(1, 10), now=0.0)
    core.submit(request(2, 10), now=0.0)
    first = fire(core)
    assert [r.corr for r in first.requests] == [1]
    core.drop(1)
    assert {r.corr for b in drain(core) for r in b.requests} == {2}


def test_after_a_pass_it_waits_for_every_context_of_that_pass() -> None:
    core = BatchFormer(BatchPolicy())
    for corr in (1, 2):
        core.submit(request(corr), now=0.0)
    assert core.next_batch(0.0) is not None
    core.pass_finished(0.5, now=1.0)
    core.submit(request(3, context=1), now=1.0)
    assert core.next_batch(1.0) is None
    assert core.deadline() == 1.5
    core.submit(request(4, context=2), now=1.1)
    batch = core.next_batch(1.1)
    assert batch is not None and [r.corr for r in batch.requests] == [3, 4]


def test_the_watchdog_fires_when_an_awaited_context_stays_quiet() -> None:
    core = BatchFormer(BatchPolicy())
    for corr in (1, 2):
        core.submit(request(corr), now=0.0)
    assert core.next_batch(0.0) is not None
    core.pass_finished(0.5, now=1.0)
    core.submit(request(3, context=1), now=1.0)
    assert core.next_batch(1.49) is None
    batch = core.next_batch(1.5)
    assert batch is not None and [r.corr for r in batch.requests] == [3]


def test_the_watchdog_waits_longer_after_contexts_came_back_slowly() -> None:
    core = BatchFormer(BatchPolicy())
    for corr in (1, 2):
        core.submit(request(corr), now=0.0)
    assert core.next_batch(0.0) is not None
    core.pass_finished(0.5, now=1.0)
    core.submit(request(3, context=1), now=1.2)
    core.submit(request(4, context=2), now=1.45)
    assert core.next_batch(1.45) is not None
    core.pass_finished(0.5, now=2.0)
    core.submit(request(5, context=1), now=2.0)
    assert core.deadline() == pytest.approx(2.0 + 1.25 * 0.45)


def test_the_watchdog_never_waits_more_than_two_pass_times() -> None:
    core = BatchFormer(BatchPolicy())
    for corr in (1, 2):
        core.submit(request(corr), now=0.0)
    assert core.next_batch(0.0) is not None
    core.pass_finished(0.5, now=1.0)
    core.submit(request(3, context=1), now=1.9)
    core.submit(request(4, context=2), now=1.9)
    assert core.next_batch(1.9) is not None
    core.pass_finished(0.5, now=2.5)
    core.submit(request(5, context=1), now=2.5)
    assert core.deadline() == pytest.approx(3.5)


def test_before_the_first_pass_queued_work_is_due_at_once() -> None:
    core = BatchFormer(BatchPolicy())
    core.submit(request(1), now=0.0)
    deadline = core.deadline()
    assert deadline is not None and deadline <= 0.0


def test_a_context_granted_a_lease_is_not_awaited() -> None:
    lease = Lease(
        lease=1,
        context=2,
        requester="a",
        pages=(2,),
        owned=1,
        masked_pages=(),
        next_slot=1,
        next_position=1,
        op=Argmax(),
    )
    core = BatchFormer(BatchPolicy())
    core.submit(request(1), now=0.0)
    core.submit(request(2, lease=lease), now=0.0)
    assert core.next_batch(0.0) is not None
    core.pass_finished(0.5, now=1.0)
    # Context 2 continues on the fast path: only context 1 is waited for.
    core.submit(request(3, context=1), now=1.0)
    batch = core.next_batch(1.0)
    assert batch is not None and [r.corr for r in batch.requests] == [3]


def test_a_request_goes_at_once_when_no_context_is_awaited() -> None:
    core = BatchFormer(BatchPolicy())
    core.submit(request(1), now=0.0)
    assert core.next_batch(0.0) is not None
    core.pass_finished(0.5, now=1.0)
    core.submit(request(2, context=1), now=1.0)
    assert core.next_batch(1.0) is not None
    core.pass_finished(0.5, now=2.0)
    core.submit(request(3, context=1), now=2.0)
    core.submit(request(4, context=9), now=2.0)
    batch = core.next_batch(2.0)
    assert batch is not None and [r.corr for r in batch.requests] == [3, 4]


def test_alternating_half_batches_merge_into_one() -> None:
    core = BatchFormer(BatchPolicy())
    for context in range(7):
        core.submit(request(100 + context, context=context), now=0.0)
    assert core.next_batch(0.0) is not None
    for context in range(7, 16):
        core.submit(request(200 + context, context=context), now=0.1)
    core.pass_finished(1.0, now=1.0)
    assert core.next_batch(1.0) is None
    for context in range(7):
        core.submit(request(300 + context, context=context), now=1.01)
    batch = core.next_batch(1.01)
    assert batch is not None and len(batch.requests) == 16


def test_it_fires_at_once_when_the_queue_fills_the_token_budget() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=8))
    for corr in (1, 2, 3):
        core.submit(request(corr), now=0.0)
    fire(core, now=0.0, seconds=0.5)
    core.submit(request(4, 8), now=10.0)
    assert core.next_batch(10.0) is not None


def test_a_queue_that_fills_the_token_budget_fires_before_the_watchdog() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=8))
    for corr in (1, 2):
        core.submit(request(corr), now=0.0)
    assert core.next_batch(0.0) is not None
    core.pass_finished(0.5, now=1.0)
    core.submit(request(3, 7), now=1.0)
    assert core.next_batch(1.0) is None
    core.submit(request(4, 1), now=1.1)
    batch = core.next_batch(1.1)
    assert batch is not None and [r.corr for r in batch.requests] == [3, 4]


def test_a_queue_that_reaches_the_request_limit_fires_before_the_watchdog() -> None:
    core = BatchFormer(BatchPolicy(max_batch_requests=2))
    for corr in (1, 2):
        core.submit(request(corr), now=0.0)
    assert core.next_batch(0.0) is not None
    core.pass_finished(0.5, now=1.0)
    core.submit(request(3), now=1.0)
    assert core.next_batch(1.0) is None
    core.submit(request(4), now=1.1)
    batch = core.next_batch(1.1)
    assert batch is not None and [r.corr for r in batch.requests] == [3, 4]


def test_a_split_prefill_counts_only_its_unsent_tokens_toward_the_budget() -> None:
    core = BatchFormer(BatchPolicy(max_batch_tokens=10))
    core.submit(request(1), now=0.0)
    core.submit(request(2, 15), now=0.0)
    first = core.next_batch(0.0)
    assert first is not None and [len(r.tokens) for r in first.requests] == [1, 9]
    core.pass_finished(0.5, now=1.0)
    assert core.next_batch(1.0) is None
    core.submit(request(3, context=1), now=1.1)
    batch = core.next_batch(1.1)
    assert batch is not None and [(r.corr, len(r.tokens)) for r in batch.requests] == [
        (2, 6),
        (3, 1),
    ]


def test_nothing_fires_while_a_pass_is_in_flight() -> None:
    core = BatchFormer(BatchPolicy())
    core.submit(request(1), now=0.0)
    assert core.next_batch(0.0) is not None
    core.submit(request(2), now=0.0)
    assert core.next_batch(100.0) is None and core.deadline() is None
    assert core.statistics().in_flight
    core.pass_finished(0.0)
    assert core.next_batch(100.0) is not None


def test_batch_ids_count_up() -> None:
    core = BatchFormer(BatchPolicy())
    ids = []
    for corr in (1, 2, 3):
        core.submit(request(corr), now=0.0)
        ids.append(fire(core).batch)
    assert ids == [1, 2, 3]


def test_statistics_describe_the_batches() -> None:
    core = BatchFormer(BatchPolicy(max_batch_requests=3))
    for corr in range(1, 5):
        core.submit(request(corr, 2), now=0.0)
    fire(core, seconds=0.25)
    fire(core, now=1.0, seconds=0.125)
    stats = core.statistics()
    assert stats.batch_size_histogram == ((1, 1), (3, 1))
    assert (stats.batches, stats.requests, stats.tokens) == (2, 4, 8)
    assert stats.max_batch_size == 3 and stats.last_batch_size == 1
    assert stats.mean_batch_size == pytest.approx(2.0)
    assert stats.last_pass_seconds == 0.125 and stats.pending == 0 and not stats.in_flight


def test_a_fresh_scheduler_reports_empty_statistics() -> None:
    assert BatchFormer(BatchPolicy()).statistics() == BatchStatistics(
        batches=0,
        requests=0,
        lane_passes=0,
        tokens=0,
        chunks=0,
        pending=0,
        in_flight=False,
        last_batch_size=0,
        max_batch_size=0,
        mean_batch_size=0.0,
        last_pass_seconds=0.0,
        batch_size_histogram=(),
    )


def test_statistics_count_every_batch_of_a_size() -> None:
    core = BatchFormer(BatchPolicy())
    for corr in (1, 2, 3):
        core.submit(request(corr, 2, context=1), now=0.0)
        fire(core, seconds=0.25)
    assert core.statistics() == BatchStatistics(
        batches=3,
        requests=3,
        lane_passes=0,
        tokens=6,
        chunks=0,
        pending=0,
        in_flight=False,
        last_batch_size=1,
        max_batch_size=1,
        mean_batch_size=1.0,
        last_pass_seconds=0.25,
        batch_size_histogram=((1, 3),),
    )


def test_limits_of_one_are_accepted() -> None:
    policy = BatchPolicy(max_batch_tokens=1, max_batch_requests=1)
    assert (policy.max_batch_tokens, policy.max_batch_requests) == (1, 1)


def test_limits_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="batch limits"):
        BatchPolicy(max_batch_tokens=0)
