"""Lanes: the fast path for plain decodes, and the passes staged ahead on it.

A lane is one context's lease (see pie/events/speculation.py) as the driver thread sees it.
Programs submit plain decodes to their lane from their own threads; the pass loop runs lane
passes from the driver thread. Neither waits for the Trio thread: the kv actor hears of each
pass afterwards through `post`, in the order things happened.

With a speculation depth of D, when a lane pass ends the speculator (speculator.py) stages the
next one (the token just sampled, at the next position, with the same sampler and the next
seed of its stream) and keeps up to D passes ahead of what its program has asked for. A request
that matches the first staged pass claims it, whether it is queued, running or done; any other
request drops every staged pass of the lane. A pass claimed before it has ended has its
follower staged at once, WAITING for the token it will sample; when it ends, the driver thread
fills that token in and queues the follower, and leaves handing the claimed pass over to
`run`, off its path to the next pass. Staged passes write only KV slots past the
context's end, in pages the lease pins, and the kv actor only ever appends what a program
received, so a pass thrown away leaves nothing behind: the next pass writes over its slot.

Locking: one condition (`cond`, over `lock`) guards every lane and the ready queue. Deliveries
to programs and posts to Trio are made after it is released, posts first, so that the kv actor
has appended a token before its program can send anything that depends on it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

from attrs import define, field

from pie.dataplane.lane import (
    DONE,
    QUEUED,
    RUNNING,
    WAITING,
    Deliver,
    Lane,
    LanePass,
    follower,
)
from pie.dataplane.speculator import SpeculationStatistics, Speculator
from pie.events.batching import ForwardCompleted
from pie.events.kv import RequestFailed
from pie.events.sampling import SAMPLERS, SamplingSlot, SlotOp, SlotOutput, TokenOutput
from pie.events.speculation import (
    LaneBusy,
    LanePassApplied,
    LanePassesApplied,
    Lease,
    LeaseReleased,
)

Post = Callable[[list[tuple[str, Any]]], None]
"""Hands (destination, event) pairs to the Trio thread, in order, without waiting."""

__all__ = ["DONE", "Effects", "LaneBusy", "LanePass", "Lanes"]


@define
class Effects:
    """What to do once the lock is released: hand claimed passes over, then post to Trio,
    then deliver. A lane pass handed over stands for its `LanePassApplied` among the events
    and for its `ForwardCompleted` among the deliveries: they are built in `run`, off the pass
    loop's path from one pass to the next, and so is the hand-over of the claimed passes that
    ended (`handed`), which the next pass does not wait for."""

    events: list[tuple[str, Any]] = field(factory=list)
    deliveries: list[tuple[Deliver, Any]] = field(factory=list)
    handed: list[LanePass] = field(factory=list)


class Lanes:
    def __init__(
        self,
        *,
        page_size: int,
        vocab_size: int,
        depth: int,
        post: Post,
        address: str = "kv",
        chain: bool = False,
    ) -> None:
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.speculator = Speculator(depth)
        self.speculator.chain = self.chain = chain
        """Whether the pass loop chains passes on the device (see `take_chained`)."""
        self.lock = threading.RLock()
        """The lock of `cond`, taken directly where nothing waits or is notified: entering it is
        one C call, where entering the condition is a Python frame more."""
        self.cond = threading.Condition(self.lock)
        self._post = post
        self._kv = address
        self._lanes: dict[int, Lane] = {}
        self._ready: collections.deque[LanePass] = collections.deque()
        self.ready = 0
        """Queued passes that will run (those dropped while queued are not counted)."""
        self._requesters: set[str] = set()
        self.awaited: set[Lane] = set()
        """Lanes that took part in the last pass, with nothing queued or running, whose program
        is expected to submit next: the pass loop waits a little for them before firing."""

    # -- any thread --------------------------------------------------------------------------

    def open_requester(self, requester: str) -> None:
        """`requester` may hold lanes (its contexts' leases are used)."""
        with self.lock:
            self._requesters.add(requester)

    def close_requester(self, requester: str) -> None:
        """Closes every lane of `requester`, which is gone."""
        effects = Effects()
        with self.lock:
            self._requesters.discard(requester)
            for lane in [la for la in self._lanes.values() if la.lease.requester == requester]:
                self._close(lane, effects)
        self.run(effects)

    def statistics(self) -> SpeculationStatistics:
        with self.lock:
            return self.speculator.statistics()

    # -- program threads ---------------------------------------------------------------------

    def submit(
        self,
        context: int,
        requester: str,
        corr: int,
        tokens: Sequence[int],
        positions: Sequence[int] | None,
        slots: Sequence[SamplingSlot],
        deliver: Deliver,
        *,
        adapter: str | None = None,
    ) -> bool:
        """Takes a pass on the context's lane, staged or run on demand; False when the pass is
        not a plain decode the lane can run (or names another adapter than its lease), in which
        case the lane is closed and the pass must go the slow way. Raises LaneBusy while the
        lane's last pass is undelivered."""
        effects = Effects()
        with self.lock:
            lane = self._lanes.get(context)
            if lane is None or lane.lease.requester != requester:
                return False
            if lane.pending is not None:
                raise LaneBusy(f"context {context} has a pass in flight")
            if lane.lease.adapter != adapter or not self._fits(lane, tokens, positions, slots):
                self._close(lane, effects)
                taken = False
            else:
                self._take(lane, corr, tokens[0], slots[0].op, deliver, effects)
                taken = True
        self.run(effects)
        return taken

    def close(self, context: int, requester: str, *, running_ok: bool = False) -> None:
        """Takes the context off the fast path before a command that changes it. Raises
        LaneBusy while a pass its program asked for is undelivered, unless `running_ok`
        (destroying the context), in which case that pass is still delivered."""
        effects = Effects()
        with self.lock:
            lane = self._lanes.get(context)
            if lane is None or lane.lease.requester != requester:
                return
            if lane.pending is not None and not running_ok:
                raise LaneBusy(f"context {context} has a pass in flight")
            self._close(lane, effects)
        self.run(effects)

    # -- the pass loop (driver thread) -------------------------------------------------------

    def take_ready(self, limit: int) -> list[LanePass]:
        """Up to `limit` queued passes, marked running (the caller holds `cond`)."""
        taken: list[LanePass] = []
        while self._ready and len(taken) < limit:
            lane_pass = self._ready.popleft()
            if lane_pass.dropped:
                continue
            lane_pass.state = RUNNING
            self.ready -= 1
            self.awaited.discard(lane_pass.lane)
            taken.append(lane_pass)
        return taken

    def take_chained(self, launched: Sequence[LanePass]) -> list[tuple[LanePass, int]]:
        """The passes WAITING for the tokens of `launched` (the lane passes of the pass on the
        device), marked running, each with the index in `launched` of the pass it follows: the
        pass loop runs them next, reading those tokens on the device (the caller holds `cond`;
        `completed` fills their tokens in afterwards)."""
        chained: list[tuple[LanePass, int]] = []
        for i, lane_pass in enumerate(launched):
            following = follower(lane_pass)
            if following is not None and following.state == WAITING:
                following.state = RUNNING
                self.awaited.discard(following.lane)
                chained.append((following, i))
        self.speculator.chained += len(chained)
        return chained

    def opened(self, lease: Lease, output: SlotOutput | None) -> Effects:
        """The pass that granted `lease` ended (`output` None: it failed). The caller runs
        the effects returned (`run`), in order with every other batch of them."""
        effects = Effects()
        with self.lock:
            old = self._lanes.get(lease.context)
            if old is not None:
                self._close(old, effects)
            if not isinstance(output, TokenOutput) or lease.requester not in self._requesters:
                effects.events.append(
                    (self._kv, LeaseReleased(lease=lease.lease, context=lease.context))
                )
            else:
                lane = Lane(
                    lease=lease,
                    page_size=self.page_size,
                    base_slot=lease.next_slot,
                    base_position=lease.next_position,
                    base_token=output.token,
                    base_op=lease.op,
                )
                self._lanes[lease.context] = lane
                self.speculator.leases += 1
                self._stage(lane)
        return effects

    def completed(
        self, passes: Sequence[LanePass], outputs: Sequence[SlotOutput | None]
    ) -> Effects:
        """The pass loop ran `passes` (None outputs failed): queues the passes waiting for
        their tokens, stages what follows the others, and returns the claimed passes to hand
        over, the posts and the deliveries for the caller to `run`."""
        effects = Effects()
        with self.lock:
            for lane_pass, output in zip(passes, outputs, strict=True):
                self._completed(lane_pass, output, effects)
        return effects

    def run(self, effects: Effects) -> None:
        """Hands claimed passes over, posts to Trio, then delivers to programs. Effects of one
        lane are run in the order they were made: those of the pass loop on one thread, one
        batch after another; a program's own only once it has received everything before
        them."""
        if effects.handed:
            with self.lock:
                for lane_pass in effects.handed:
                    self._hand_over(lane_pass, effects)
        events = self._batched(effects.events)
        if events:
            self._post(events)
        for deliver, value in effects.deliveries:
            if isinstance(value, LanePass):
                outputs = (value.output,)
                value = ForwardCompleted(
                    corr=value.corr,
                    context=value.lane.lease.context,
                    outputs=outputs,  # type: ignore[arg-type]
                )
            deliver(value)

    def _batched(self, events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The events to post, each run of lane passes handed over as one LanePassesApplied."""
        posted: list[tuple[str, Any]] = []
        run: list[LanePassApplied] = []
        for to, event in events:
            if isinstance(event, LanePass):
                run.append(self._applied(event))
                continue
            if run:
                posted.append((self._kv, LanePassesApplied(passes=tuple(run))))
                run = []
            posted.append((to, event))
        if run:
            posted.append((self._kv, LanePassesApplied(passes=tuple(run))))
        return posted

    @staticmethod
    def _applied(lane_pass: LanePass) -> LanePassApplied:
        lane = lane_pass.lane
        return LanePassApplied(
            lease=lane.lease.lease,
            context=lane.lease.context,
            corr=lane_pass.corr,
            token=lane_pass.token,
            position=lane_pass.position,
            page=lane.page_of(lane_pass.slot),
            staged=lane_pass.staged,
            outputs=(lane_pass.output,),  # type: ignore[arg-type]
        )

    # -- internals (callers hold `cond`) -----------------------------------------------------

    def _fits(
        self,
        lane: Lane,
        tokens: Sequence[int],
        positions: Sequence[int] | None,
        slots: Sequence[SamplingSlot],
    ) -> bool:
        return (
            len(tokens) == 1
            and 0 <= tokens[0] < self.vocab_size
            and (positions is None or tuple(positions) == (lane.base_position,))
            and len(slots) == 1
            and slots[0].index == 0
            and isinstance(slots[0].op, SAMPLERS)
            and lane.base_slot < lane.capacity
        )

    def _take(
        self, lane: Lane, corr: int, token: int, op: SlotOp, deliver: Deliver, effects: Effects
    ) -> None:
        claimed = self.speculator.claim(lane, token, op)
        if claimed is not None:
            claimed.corr, claimed.deliver = corr, deliver
            if claimed.state == DONE:
                self._hand_over(claimed, effects)
            else:
                lane.pending = claimed
                self._stage(lane)
            return
        self._drop_staged(lane)
        direct = LanePass(
            lane=lane,
            token=token,
            position=lane.base_position,
            slot=lane.base_slot,
            op=op,
            staged=False,
            corr=corr,
            deliver=deliver,
        )
        lane.pending = direct
        self.speculator.direct += 1
        lane.live += 1
        self._queue(direct)
        self._stage(lane)

    def _completed(self, lane_pass: LanePass, output: SlotOutput | None, effects: Effects) -> None:
        lane = lane_pass.lane
        lane_pass.state = DONE
        lane_pass.output = output
        lane.live -= 1
        if lane_pass.dropped:
            self.speculator.wasted_passes += 1
        elif output is None:
            # A lane pass the driver refused: nothing in it can be trusted to go on from.
            if lane_pass.deliver is not None:
                failed = RequestFailed(
                    corr=lane_pass.corr, kind="driver", message="the forward pass failed"
                )
                effects.deliveries.append((lane_pass.deliver, failed))
                lane.pending = None
            self._close(lane, effects)
        elif lane_pass.deliver is not None:
            self._resolve(lane_pass)
            effects.handed.append(lane_pass)
            if not lane.closed and not lane.staged:
                self.awaited.add(lane)
        else:
            if self.chain:  # only a chain stages a pass after an unclaimed one that runs
                self._resolve(lane_pass)
            self._stage(lane)
            if lane.live == 0 and not lane.closed:
                # Staged as deep as allowed and its program is behind: the next pass waits a
                # little for it, like for a program that has just been answered.
                self.awaited.add(lane)
        if lane.closed:
            self._maybe_release(lane, effects)

    def _hand_over(self, lane_pass: LanePass, effects: Effects) -> None:
        """Delivers a claimed pass that is done, after telling the kv actor of it."""
        lane = lane_pass.lane
        assert lane_pass.deliver is not None and lane_pass.output is not None
        if not lane.closed:
            effects.events.append((self._kv, lane_pass))
        effects.deliveries.append((lane_pass.deliver, lane_pass))
        if lane.pending is lane_pass:
            lane.pending = None
        lane.base_slot = lane_pass.slot + 1
        lane.base_position = lane_pass.position + 1
        out = lane_pass.output
        lane.base_token = out.token if isinstance(out, TokenOutput) else None
        lane.base_op = lane_pass.op
        if not lane.closed:
            self._stage(lane)

    def _resolve(self, ended: LanePass) -> None:
        """Fills in the token of the pass following `ended` (which has just ended), and queues
        it when it was WAITING (a chained one is running already). The driver thread does
        this, the one thread that waits on `cond`: no one to notify; and a lane whose pass was
        running is not awaited."""
        following = follower(ended)
        if following is None or following.state not in (WAITING, RUNNING) or following.token >= 0:
            return
        output = ended.output
        assert isinstance(output, TokenOutput)
        following.token = output.token
        if following.state == WAITING:
            following.state = QUEUED
            self.ready += 1
            self._ready.append(following)

    def _stage(self, lane: Lane) -> None:
        staged = self.speculator.stage(lane)
        if staged is not None:
            lane.live += 1
            if staged.state == QUEUED:
                self._queue(staged)

    def _queue(self, lane_pass: LanePass) -> None:
        self.ready += 1
        self._ready.append(lane_pass)
        self.awaited.discard(lane_pass.lane)
        self.cond.notify_all()

    def _drop_staged(self, lane: Lane) -> None:
        unrun = self.speculator.drop(lane)
        lane.live -= len(unrun)
        self.ready -= sum(1 for p in unrun if p.state == QUEUED)

    def _close(self, lane: Lane, effects: Effects) -> None:
        if lane.closed:
            return
        lane.closed = True
        self._drop_staged(lane)
        self.awaited.discard(lane)
        if self._lanes.get(lane.lease.context) is lane:
            del self._lanes[lane.lease.context]
        self._maybe_release(lane, effects)

    def _maybe_release(self, lane: Lane, effects: Effects) -> None:
        if lane.live == 0 and not lane.released:
            lane.released = True
            released = LeaseReleased(lease=lane.lease.lease, context=lane.lease.context)
            effects.events.append((self._kv, released))
