"""One context's lane: its lease and the passes run or staged on it (lanes.py coordinates the
lanes; speculator.py predicts and stages their passes)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from attrs import define, field

from pie.events.sampling import SlotOp, SlotOutput
from pie.events.speculation import Lease

QUEUED, RUNNING, DONE, WAITING = 0, 1, 2, 3
"""WAITING: staged after the claimed pass while that one has not ended; its token is what that
pass samples, filled in (and the pass queued) when it ends."""
SEED_MODULUS = 2**63
"""Seeds live in 0..2**63-1; a stream's next seed wraps around there (the SDK's rule)."""

Deliver = Callable[[Any], None]
"""Fills a program's pollable with a ForwardCompleted or a RequestFailed."""


@define(eq=False)
class LanePass:
    lane: Lane
    token: int
    position: int
    slot: int
    op: SlotOp
    staged: bool
    state: int = QUEUED
    """QUEUED, RUNNING, DONE or WAITING (its `token` is not known yet)."""
    output: SlotOutput | None = None
    corr: int = 0
    deliver: Deliver | None = None
    dropped: bool = False


@define(eq=False)
class Lane:
    lease: Lease
    page_size: int
    base_slot: int
    """Where the pass after every claimed one writes."""
    base_position: int
    base_token: int | None
    """The token the next pass would feed: the last claimed pass's output, once known."""
    base_op: SlotOp
    pending: LanePass | None = None
    """A claimed pass not yet delivered (at most one: a context runs one pass at a time)."""
    staged: collections.deque[LanePass] = field(factory=collections.deque)
    live: int = 0
    """Passes waiting, queued or running that will still run (claimed or staged)."""
    seed_step: int = 1
    """How far the program moves its sampler's seed per pass, as the speculator learned it."""
    closed: bool = False
    released: bool = False

    @property
    def capacity(self) -> int:
        return len(self.lease.pages) * self.page_size

    def pages_for(self, slot: int) -> tuple[int, ...]:
        return self.lease.pages[: slot // self.page_size + 1]

    def page_of(self, slot: int) -> int:
        return self.lease.pages[slot // self.page_size]


def follower(lane_pass: LanePass) -> LanePass | None:
    """The staged pass after `lane_pass` on its lane: the first of the chain after the claimed
    pass, else the next one of the chain; None when there is none or it was dropped."""
    lane = lane_pass.lane
    if lane_pass.dropped:
        return None
    if lane_pass is lane.pending:
        return lane.staged[0] if lane.staged else None
    staged = lane.staged
    for i, candidate in enumerate(staged):
        if candidate is lane_pass:
            return staged[i + 1] if i + 1 < len(staged) else None
    return None
