"""Lanes on their own: staging, hits, misses, seeds, closing and lease release, driven by direct
calls in place of the pass loop and the programs."""

from __future__ import annotations

from typing import Any

import pytest

from pie.dataplane.lanes import DONE, LaneBusy, LanePass, Lanes
from pie.dataplane.speculator import SpeculationStatistics
from pie.events.batching import ForwardCompleted
from pie.events.kv import RequestFailed
from pie.events.sampling import Argmax, SamplingSlot, SlotOp, TokenOutput, TopP
from pie.events.speculation import LanePassApplied, LanePassesApplied, Lease, LeaseReleased

pytestmark = pytest.mark.unit

PAGE = 4


class Harness:
    def __init__(self, depth: int, pages: int = 3, op: SlotOp | None = None) -> None:
        self.posted: list[tuple[str, Any]] = []
        self.lanes = Lanes(page_size=PAGE, vocab_size=100, depth=depth, post=self.posted.extend)
        self.lanes.open_requester("p")
        self.lease = Lease(
            lease=7,
            context=1,
            requester="p",
            pages=tuple(range(10, 10 + pages)),
            owned=1,
            masked_pages=(),
            next_slot=2,
            next_position=2,
            op=op or Argmax(),
        )
        self.got: list[Any] = []

    def open(self, token: int = 5) -> None:
        self.lanes.run(self.lanes.opened(self.lease, TokenOutput(token=token)))

    def run_ready(self, answer: Any = None) -> list[LanePass]:
        """One pass over everything queued; the model answers token + 1 unless told."""
        with self.lanes.cond:
            passes = self.lanes.take_ready(64)
        outputs = [TokenOutput(token=answer if answer is not None else p.token + 1) for p in passes]
        self.lanes.run(self.lanes.completed(passes, outputs))
        return passes

    def submit(self, token: int, op: SlotOp | None = None, corr: int = 1) -> bool:
        slot = SamplingSlot(index=0, op=op or self.lease.op)
        return self.lanes.submit(1, "p", corr, (token,), None, (slot,), self.got.append)

    def events(self, kind: type) -> list[Any]:
        """What was posted of `kind`, the passes of each LanePassesApplied one by one."""
        flat = [
            e
            for _, posted in self.posted
            for e in (posted.passes if isinstance(posted, LanePassesApplied) else (posted,))
        ]
        return [e for e in flat if isinstance(e, kind)]

    def tally(self) -> SpeculationStatistics:
        return self.lanes.statistics()


def test_a_staged_pass_serves_the_matching_request_and_the_next_is_staged() -> None:
    h = Harness(depth=1)
    h.open(token=5)
    [staged] = h.run_ready()
    assert (staged.token, staged.slot, staged.position, staged.staged) == (5, 2, 2, True)
    assert h.submit(5)
    # Done before it was claimed: delivered at once, and the kv actor heard first.
    assert h.got == [ForwardCompleted(corr=1, context=1, outputs=(TokenOutput(token=6),))]
    [applied] = h.events(LanePassApplied)
    assert (applied.token, applied.position, applied.page, applied.staged) == (5, 2, 10, True)
    [following] = h.run_ready()
    assert (following.token, following.slot) == (6, 3)
    assert h.tally().hits == 1 and h.tally().staged == 2


def test_a_request_claims_a_pass_still_queued_and_receives_it_when_it_ends() -> None:
    h = Harness(depth=1)
    h.open(token=5)
    assert h.submit(5, corr=9)
    assert h.got == []
    with pytest.raises(LaneBusy):
        h.submit(6)
    h.run_ready()
    assert h.got == [ForwardCompleted(corr=9, context=1, outputs=(TokenOutput(token=6),))]


def test_the_pass_after_a_claimed_one_is_queued_with_its_token_as_it_ends() -> None:
    h = Harness(depth=1)
    h.open(token=5)
    with h.lanes.cond:
        [running] = h.lanes.take_ready(8)
    assert h.submit(5, corr=3)  # claims the running pass; the next one waits for its token
    assert h.lanes.ready == 0
    effects = h.lanes.completed([running], [TokenOutput(token=6)])
    # Queued at once, before the claimed pass is handed over to its program.
    with h.lanes.cond:
        [following] = h.lanes.take_ready(8)
    assert (following.token, following.slot, following.staged) == (6, 3, True)
    assert h.got == [] and h.events(LanePassApplied) == []
    with pytest.raises(LaneBusy):
        h.lanes.close(1, "p")  # still the program's pass in flight until handed over
    h.lanes.run(effects)
    assert h.got == [ForwardCompleted(corr=3, context=1, outputs=(TokenOutput(token=6),))]
    assert [e.token for e in h.events(LanePassApplied)] == [5]
    assert h.submit(6, corr=4)
    assert h.tally().hits == 2 and h.tally().staged == 3  # and the next waits again


def test_a_waiting_pass_is_dropped_with_its_lane_when_the_claimed_pass_fails() -> None:
    h = Harness(depth=1)
    h.open(token=5)
    assert h.submit(5, corr=4)  # claims the queued pass; the next one waits for it
    with h.lanes.cond:
        passes = h.lanes.take_ready(8)
    h.lanes.run(h.lanes.completed(passes, [None]))
    assert isinstance(h.got[0], RequestFailed)
    assert h.lanes.ready == 0 and h.events(LeaseReleased) == [LeaseReleased(lease=7, context=1)]


def test_a_different_token_drops_the_chain_and_runs_on_demand() -> None:
    h = Harness(depth=4)
    h.open(token=5)
    h.run_ready()
    h.run_ready()  # two staged passes have run, none claimed
    assert h.submit(42)
    counts = h.tally()
    assert counts.misses == 1 and counts.dropped_chains == 1 and counts.wasted_passes == 2
    [direct] = h.run_ready()
    assert (direct.token, direct.slot, direct.staged) == (42, 2, False)
    assert h.got[-1].outputs == (TokenOutput(token=43),)
    assert h.events(LanePassApplied)[-1].staged is False


def test_seeded_samplers_are_predicted_one_seed_on_and_a_fixed_seed_is_learned() -> None:
    h = Harness(depth=1, op=TopP(p=0.9, seed=2**63 - 1))
    h.open(token=5)
    [staged] = h.run_ready()
    assert staged.op == TopP(p=0.9, seed=0)  # the stream wraps around
    assert h.submit(5, op=TopP(p=0.9, seed=0))
    # A program that keeps its seed misses once, and is predicted right from then on.
    [following] = h.run_ready()
    assert following.op == TopP(p=0.9, seed=1)
    assert h.submit(6, op=TopP(p=0.9, seed=0), corr=2)
    h.run_ready()
    [again] = h.run_ready()
    assert again.op == TopP(p=0.9, seed=0) and again.staged
    assert h.tally().misses == 1


def test_a_plain_request_that_the_lane_cannot_run_closes_it() -> None:
    h = Harness(depth=1)
    h.open(token=5)
    slots = (SamplingSlot(index=0, op=Argmax()),)
    assert not h.lanes.submit(1, "p", 3, (5, 6), None, slots, h.got.append)
    # The staged pass was queued, never run: the lease is released at once.
    assert h.events(LeaseReleased) == [LeaseReleased(lease=7, context=1)]
    assert not h.submit(5)  # no lane any more


def test_the_lease_is_released_only_after_its_running_pass_ends() -> None:
    h = Harness(depth=1)
    h.open(token=5)
    with h.lanes.cond:
        [running] = h.lanes.take_ready(8)
    h.lanes.close(1, "p")
    assert h.events(LeaseReleased) == []
    h.lanes.run(h.lanes.completed([running], [TokenOutput(token=6)]))
    assert h.events(LeaseReleased) == [LeaseReleased(lease=7, context=1)]
    assert h.tally().wasted_passes == 1


def test_closing_with_a_claimed_pass_is_busy_unless_destroying() -> None:
    h = Harness(depth=0)
    h.open(token=5)
    assert h.submit(5)
    with pytest.raises(LaneBusy):
        h.lanes.close(1, "p")
    h.lanes.close(1, "p", running_ok=True)
    h.run_ready()
    # Delivered, but not applied: the context is going away.
    assert h.got and h.events(LanePassApplied) == []
    assert h.events(LeaseReleased) == [LeaseReleased(lease=7, context=1)]


def test_staging_stops_at_the_end_of_the_leased_pages() -> None:
    h = Harness(depth=1, pages=1)  # slots 0..3; the lane starts at slot 2
    h.open(token=5)
    [staged] = h.run_ready()
    assert staged.slot == 2
    assert h.submit(5)
    [last] = h.run_ready()
    assert last.slot == 3
    assert h.submit(6, corr=2)
    assert h.run_ready() == []  # nothing more fits
    assert not h.submit(7, corr=3)  # the slow path takes over
    assert h.events(LeaseReleased)


def test_a_failed_lane_pass_fails_its_request_and_closes_the_lane() -> None:
    h = Harness(depth=0)
    h.open(token=5)
    assert h.submit(5, corr=4)
    with h.lanes.cond:
        passes = h.lanes.take_ready(8)
    h.lanes.run(h.lanes.completed(passes, [None]))
    assert isinstance(h.got[0], RequestFailed) and h.got[0].corr == 4
    assert h.events(LeaseReleased)


def test_a_lease_for_a_program_that_has_gone_is_released() -> None:
    h = Harness(depth=1)
    h.lanes.close_requester("p")
    h.open(token=5)
    assert h.events(LeaseReleased) == [LeaseReleased(lease=7, context=1)]
    with h.lanes.cond:
        assert h.lanes.take_ready(8) == []


def test_passes_are_done_once_they_have_run() -> None:
    h = Harness(depth=1)
    h.open()
    [staged] = h.run_ready()
    assert staged.state == DONE and staged.output == TokenOutput(token=6)
