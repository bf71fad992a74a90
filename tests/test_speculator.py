"""The speculator on its own: what it stages and how deep, which requests are hits, how it
learns a program's seed stride from a miss, and what it counts."""

from __future__ import annotations

import pytest

from pie.dataplane.lane import DONE, QUEUED, RUNNING, WAITING, Lane, LanePass
from pie.dataplane.speculator import SpeculationStatistics, Speculator
from pie.events.sampling import Argmax, SlotOp, TokenOutput, TopK
from pie.events.speculation import Lease

pytestmark = pytest.mark.unit

PAGE = 4


def lane(op: SlotOp | None = None, pages: int = 2, next_slot: int = 2) -> Lane:
    op = op or Argmax()
    lease = Lease(
        lease=1,
        context=1,
        requester="p",
        pages=tuple(range(pages)),
        owned=1,
        masked_pages=(),
        next_slot=next_slot,
        next_position=next_slot,
        op=op,
    )
    return Lane(
        lease=lease,
        page_size=PAGE,
        base_slot=next_slot,
        base_position=next_slot,
        base_token=7,
        base_op=op,
    )


def finish(staged: LanePass | None, token: int) -> None:
    assert staged is not None
    staged.state = DONE
    staged.output = TokenOutput(token=token)


def test_it_stages_the_token_just_sampled_at_the_next_position() -> None:
    speculator, one = Speculator(depth=1), lane()
    staged = speculator.stage(one)
    assert staged is not None and staged.staged
    assert (staged.token, staged.position, staged.slot, staged.op) == (7, 2, 2, Argmax())
    assert list(one.staged) == [staged] and speculator.statistics().staged == 1


def test_it_stages_no_deeper_than_its_depth_and_only_on_known_tokens() -> None:
    speculator, one = Speculator(depth=2), lane()
    first = speculator.stage(one)
    assert first is not None and speculator.stage(one) is None  # its token is not known yet
    finish(first, 9)
    second = speculator.stage(one)
    assert second is not None and (second.token, second.slot) == (9, 3)
    finish(second, 11)
    assert speculator.stage(one) is None and len(one.staged) == 2


def test_after_the_claimed_pass_still_running_the_next_waits_for_its_token() -> None:
    speculator, one = Speculator(depth=1), lane()
    claimed = speculator.stage(one)
    assert claimed is not None and speculator.claim(one, 7, Argmax()) is claimed
    claimed.state = RUNNING
    one.pending = claimed
    following = speculator.stage(one)
    assert following is not None and following.state == WAITING
    assert (following.slot, following.position, following.op) == (3, 3, Argmax())
    assert speculator.stage(one) is None  # one unclaimed pass: the depth
    assert speculator.drop(one) == [following] and following.dropped


def test_depth_zero_stages_nothing() -> None:
    assert Speculator(depth=0).stage(lane()) is None


def test_a_negative_depth_is_refused() -> None:
    with pytest.raises(ValueError, match="depth"):
        Speculator(depth=-1)


def test_it_stops_staging_where_the_leased_pages_end() -> None:
    speculator = Speculator(depth=8)
    last = speculator.stage(lane(pages=1, next_slot=PAGE - 1))
    assert last is not None and last.slot == PAGE - 1
    assert speculator.stage(lane(pages=1, next_slot=PAGE)) is None


def test_a_matching_request_claims_the_first_staged_pass() -> None:
    speculator, one = Speculator(depth=1), lane()
    staged = speculator.stage(one)
    assert speculator.claim(one, 7, Argmax()) is staged and not one.staged
    assert speculator.statistics().hits == 1


def test_another_token_or_sampler_is_a_miss_that_claims_nothing() -> None:
    speculator, one = Speculator(depth=1), lane()
    speculator.stage(one)
    assert speculator.claim(one, 8, Argmax()) is None
    assert speculator.claim(one, 7, TopK(k=3, temperature=1.0)) is None
    assert speculator.statistics().misses == 2 and len(one.staged) == 1


def test_a_request_with_nothing_staged_is_neither_hit_nor_miss() -> None:
    speculator = Speculator(depth=1)
    assert speculator.claim(lane(), 7, Argmax()) is None
    assert speculator.statistics() == SpeculationStatistics(depth=1)


def test_seeds_advance_by_one_per_pass_until_a_miss_teaches_another_stride() -> None:
    seeded = TopK(k=5, temperature=1.0, seed=10)
    speculator, one = Speculator(depth=1), lane(seeded)
    staged = speculator.stage(one)
    assert staged is not None and staged.op == TopK(k=5, temperature=1.0, seed=11)
    # The program kept its seed: predicted so from now on.
    assert speculator.claim(one, 7, seeded) is None
    assert one.seed_step == 0
    speculator.drop(one)
    again = speculator.stage(one)
    assert again is not None and again.op == seeded


def test_dropping_a_chain_counts_what_ran_for_nothing_and_returns_what_is_queued() -> None:
    speculator, one = Speculator(depth=3), lane()
    done = speculator.stage(one)
    finish(done, 9)
    running = speculator.stage(one)
    assert running is not None
    running.state = RUNNING
    finish(running, 10)
    queued = speculator.stage(one)
    assert queued is not None and queued.state == QUEUED
    assert speculator.drop(one) == [queued]
    assert all(p.dropped for p in (done, running, queued)) and not one.staged
    stats = speculator.statistics()
    assert (stats.dropped_chains, stats.wasted_passes) == (1, 2)
    assert speculator.drop(one) == [] and speculator.statistics().dropped_chains == 1


def test_the_hit_rate_is_hits_per_staged_pass_settled() -> None:
    stats = SpeculationStatistics(depth=1, staged=10, hits=4, wasted_passes=1)
    assert stats.hit_rate == pytest.approx(0.8)
    assert SpeculationStatistics(depth=1).hit_rate == 0.0
