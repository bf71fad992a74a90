"""The speculator: it predicts each lane's next pass (the token just sampled, at the next
position, with the sampler its program will ask for) and stages it ahead, decides whether a
program's request is the pass it staged, and counts what came of it. Lanes (lanes.py) call it
under their lock; it keeps no lock and no thread of its own."""

from __future__ import annotations

import attrs
from attrs import frozen

from pie.dataplane.lane import DONE, QUEUED, SEED_MODULUS, WAITING, Lane, LanePass
from pie.events.sampling import SlotOp, TokenOutput


@frozen(kw_only=True)
class SpeculationStatistics:
    depth: int
    staged: int = 0
    """Passes built ahead of their program's request."""
    hits: int = 0
    """Requests served from a staged pass."""
    misses: int = 0
    """Requests that found a different pass staged."""
    dropped_chains: int = 0
    """Staged chains thrown away (a miss, or the context left the fast path)."""
    wasted_passes: int = 0
    """Staged passes that ran and were never used."""
    direct: int = 0
    """Passes run on a lease at the program's request, with nothing staged."""
    leases: int = 0
    """Lanes opened on a granted lease."""
    chained: int = 0
    """Staged passes launched on the device behind the pass whose token they read."""

    @property
    def hit_rate(self) -> float:
        """Hits per staged pass that was settled (used or thrown away)."""
        settled = self.hits + self.wasted_passes
        return self.hits / settled if settled else 0.0


class Speculator:
    """Prediction and staging for every lane, at a depth of up to `depth` unclaimed passes."""

    def __init__(self, depth: int) -> None:
        if depth < 0:
            raise ValueError("speculation depth must be >= 0")
        self.depth = depth
        self.chain = False
        """Set when passes are chained on the device: a pass is staged WAITING after any pass
        that has not ended, claimed or not, so the chain runs ahead of its program."""
        self.staged = self.hits = self.misses = self.dropped_chains = 0
        self.wasted_passes = self.direct = self.leases = self.chained = 0

    def statistics(self) -> SpeculationStatistics:
        return SpeculationStatistics(
            depth=self.depth,
            staged=self.staged,
            hits=self.hits,
            misses=self.misses,
            dropped_chains=self.dropped_chains,
            wasted_passes=self.wasted_passes,
            direct=self.direct,
            leases=self.leases,
            chained=self.chained,
        )

    def claim(self, lane: Lane, token: int, op: SlotOp) -> LanePass | None:
        """The staged pass that is the request for (`token`, `op`) at the lane's next position,
        taken off the lane; None on a miss, after which the caller drops the lane's chain."""
        if not lane.staged:
            return None
        first = lane.staged[0]
        if first.token == token and first.op == op:
            self.hits += 1
            return lane.staged.popleft()
        self.misses += 1
        self._learn_seed_step(lane, op)
        return None

    def stage(self, lane: Lane) -> LanePass | None:
        """The lane's next pass, appended to its chain, when the depth allows and its input is
        known (the token the pass before it sampled); None otherwise. After the claimed pass
        while it has not ended (after any such pass when `chain`), the next pass is staged
        WAITING for that pass's token: deciding it then takes it off the path from that pass
        to the next."""
        if lane.closed or len(lane.staged) >= self.depth:
            return None
        before = lane.staged[-1] if lane.staged else lane.pending
        state = QUEUED
        if before is None:
            if lane.base_token is None:
                return None
            token, op = lane.base_token, lane.base_op
            slot, position = lane.base_slot - 1, lane.base_position - 1
        elif before.state == DONE:
            if not isinstance(before.output, TokenOutput):
                return None
            token, slot, position, op = before.output.token, before.slot, before.position, before.op
        elif before is lane.pending or self.chain:
            token, slot, position, op, state = -1, before.slot, before.position, before.op, WAITING
        else:
            return None
        if slot + 1 >= lane.capacity:
            return None
        staged = LanePass(
            lane=lane,
            token=token,
            position=position + 1,
            slot=slot + 1,
            op=self._predict(lane, op),
            staged=True,
            state=state,
        )
        lane.staged.append(staged)
        self.staged += 1
        return staged

    def drop(self, lane: Lane) -> list[LanePass]:
        """Throws the lane's staged chain away; returns the passes of it that have not run
        (queued or waiting)."""
        if not lane.staged:
            return []
        self.dropped_chains += 1
        queued = []
        for staged in lane.staged:
            staged.dropped = True
            if staged.state in (QUEUED, WAITING):
                queued.append(staged)
            elif staged.state == DONE:
                self.wasted_passes += 1
        lane.staged.clear()
        return queued

    @staticmethod
    def _predict(lane: Lane, op: SlotOp) -> SlotOp:
        """The sampler predicted for the pass after one run with `op`: its seed stream moves
        on by the lane's step."""
        seed = getattr(op, "seed", None)
        if seed is None or lane.seed_step == 0:
            return op
        return attrs.evolve(op, seed=(seed + lane.seed_step) % SEED_MODULUS)

    @staticmethod
    def _learn_seed_step(lane: Lane, op: SlotOp) -> None:
        """A program that reuses one seed, or strides by another step, is predicted so from
        its next pass on (`op` is what it asked for instead of the prediction)."""
        got, had = getattr(op, "seed", None), getattr(lane.base_op, "seed", None)
        if got is None or had is None or type(op) is not type(lane.base_op):
            return
        if attrs.evolve(op, seed=had) == lane.base_op:
            lane.seed_step = (got - had) % SEED_MODULUS
