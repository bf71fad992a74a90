"""The kv core driven directly: placing passes in pages, fork and copy-on-write, snapshots,
truncation, prefix sharing, reserved pages, leases for the fast path, failures that leave no
trace, and a long random churn."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from pie.actors.kv import KvCore, Quotas
from pie.actors.kv.core import KvStatistics
from pie.events import kv as ev
from pie.events.batching import ScheduleForward
from pie.events.forward import ForwardRequest, PageCopy
from pie.events.sampling import (
    Argmax,
    Entropy,
    LogitBias,
    LogProbs,
    Penalty,
    SamplingSlot,
    TopP,
)
from pie.events.speculation import LanePassApplied, Lease, LeaseReleased

pytestmark = pytest.mark.unit

PAGE = 4


class Kv:
    """A KvCore and the bookkeeping a test needs to talk to it as a few requesters."""

    def __init__(
        self,
        num_pages: int = 32,
        vocab_size: int = 100,
        prefix_cache: str = "user",
        quotas: Quotas | None = None,
        sliding_window: int | None = None,
    ) -> None:
        self.core = KvCore(
            num_pages=num_pages,
            page_size=PAGE,
            vocab_size=vocab_size,
            prefix_cache=prefix_cache,
            quotas=quotas,
            sliding_window=sliding_window,
        )
        self.pool = self.core.pool
        self._corr = itertools.count(1)

    def send(self, make: Any, requester: str = "a", **fields: Any) -> list[tuple[str, Any]]:
        return self.core.handle(make(corr=next(self._corr), requester=requester, **fields))

    def ask(self, make: Any, requester: str = "a", **fields: Any) -> Any:
        [(dst, reply)] = self.send(make, requester, **fields)
        assert dst == requester
        return reply

    def ok(self, make: Any, requester: str = "a", **fields: Any) -> Any:
        reply = self.ask(make, requester, **fields)
        assert not isinstance(reply, ev.RequestFailed), reply
        return reply

    def refused(self, make: Any, requester: str = "a", **fields: Any) -> ev.RequestFailed:
        reply = self.ask(make, requester, **fields)
        assert isinstance(reply, ev.RequestFailed), reply
        return reply

    def create(self, requester: str = "a", user: str = "local") -> int:
        return int(self.ok(ev.CreateContext, requester, user=user).context)

    def fork(self, context: int, requester: str = "a") -> int:
        return int(self.ok(ev.ForkContext, requester, context=context).context)

    def submit(
        self, context: int, tokens: Any, requester: str = "a", **fields: Any
    ) -> ForwardRequest:
        fields.update(context=context, tokens=tuple(tokens))
        [(dst, placed)] = self.send(ev.SubmitForward, requester, **fields)
        assert dst == "inference" and isinstance(placed, ScheduleForward), placed
        return placed.request

    def apply(self, request: ForwardRequest, ok: bool = True) -> None:
        applied = ev.PassApplied(corr=request.corr, context=request.context, ok=ok)
        assert self.core.handle(applied) == []

    def write(self, context: int, tokens: Any, requester: str = "a") -> ForwardRequest:
        request = self.submit(context, tokens, requester)
        self.apply(request)
        return request

    def describe(self, context: int, requester: str = "a") -> ev.ContextInfo:
        info: ev.ContextInfo = self.ok(ev.DescribeContext, requester, context=context)
        return info

    def pages(self, context: int) -> list[int]:
        return list(self.core.contexts[context].pages)

    def reserve(self, context: int, count: int, requester: str = "a") -> list[int]:
        self.ok(ev.ReserveTokens, requester, context=context, count=count)
        return list(self.core.contexts[context].reserved)


def test_submit_places_tokens_in_pages_and_continues_positions() -> None:
    kv = Kv()
    context = kv.create()
    first = kv.write(context, [1, 2, 3, 4, 5, 6])
    assert (first.kv_start, first.positions, len(first.pages)) == (0, (0, 1, 2, 3, 4, 5), 2)
    second = kv.submit(context, [7, 8, 9])
    assert second.kv_start == 6 and second.positions == (6, 7, 8)
    assert second.pages[:2] == first.pages and len(second.pages) == 3
    assert second.copies == ()
    assert kv.pool.free == 32 - 3


def test_contexts_are_numbered_from_one_in_creation_order() -> None:
    kv = Kv()
    assert [kv.create() for _ in range(3)] == [1, 2, 3]


def test_the_placed_request_carries_what_was_submitted() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    kv.ok(ev.MaskPages, context=context, pages=(0,))
    slots = (SamplingSlot(index=1, op=Argmax()),)
    submit = ev.SubmitForward(
        corr=50,
        requester="a",
        context=context,
        tokens=(6, 7),
        attention_masks=((6,), (7,)),
        logit_mask=(100,),
        slots=slots,
    )
    [(_, placed)] = kv.core.handle(submit)
    assert placed.request == ForwardRequest(
        corr=50,
        requester="a",
        context=context,
        tokens=(6, 7),
        positions=(5, 6),
        kv_start=5,
        pages=tuple(kv.pages(context)),
        masked_pages=(0,),
        attention_masks=((6,), (7,)),
        logit_mask=(100,),
        slots=slots,
        copies=(),
        lease=None,
    )


def test_a_context_runs_one_pass_at_a_time() -> None:
    kv = Kv()
    context = kv.create()
    request = kv.submit(context, [1, 2])
    assert kv.refused(ev.SubmitForward, context=context, tokens=(3,)).kind == "busy"
    assert kv.refused(ev.ForkContext, context=context).kind == "busy"
    assert kv.refused(ev.MaskPages, context=context, pages=(0,)).kind == "busy"
    kv.apply(request)
    kv.submit(context, [3])


def test_explicit_positions_are_kept_and_continued() -> None:
    kv = Kv()
    context = kv.create()
    kv.apply(kv.submit(context, [1, 2], positions=(10, 20)))
    assert kv.submit(context, [3]).positions == (21,)


def test_a_token_cut_and_written_again_keeps_its_position() -> None:
    """Positions may jump (text after a medium's span); a truncation rewinds to the first cut
    token's position, for the next write only."""
    kv = Kv()
    context = kv.create()
    kv.apply(kv.submit(context, [1, 2, 3], positions=(0, 1, 7)))
    kv.ok(ev.TruncateContext, context=context, count=1)
    assert kv.describe(context).next_position == 7
    kv.apply(kv.submit(context, [3]))
    assert kv.describe(context).positions == (0, 1, 7)
    assert kv.submit(context, [4]).positions == (8,)


def test_fork_shares_every_page_and_copies_none() -> None:
    kv = Kv()
    parent = kv.create()
    kv.write(parent, [1, 2, 3, 4, 5, 6])
    free = kv.pool.free
    child = kv.fork(parent)
    assert kv.pool.free == free
    assert kv.pages(child) == kv.pages(parent)
    assert all(kv.pool.owners(p) == 2 for p in kv.pages(parent))
    assert kv.describe(child).tokens == (1, 2, 3, 4, 5, 6)


def test_writing_to_a_forks_partial_tail_copies_it_first() -> None:
    kv = Kv()
    parent = kv.create()
    kv.write(parent, [1, 2, 3, 4, 5, 6])
    parent_pages = kv.pages(parent)
    child = kv.fork(parent)
    request = kv.submit(child, [7])
    fresh = request.pages[1]
    assert request.copies == (PageCopy(src=parent_pages[1], dst=fresh),)
    assert fresh not in parent_pages and request.pages[0] == parent_pages[0]
    kv.apply(request)
    assert kv.pages(parent) == parent_pages
    assert kv.describe(parent).tokens == (1, 2, 3, 4, 5, 6)
    assert kv.pool.owners(parent_pages[1]) == 1
    assert kv.submit(parent, [8]).copies == ()


def test_sibling_forks_are_independent() -> None:
    kv = Kv()
    parent = kv.create()
    kv.write(parent, [1, 2, 3])
    left, right = kv.fork(parent), kv.fork(parent)
    kv.write(left, [10, 11])
    kv.write(right, [20])
    assert kv.describe(left).tokens == (1, 2, 3, 10, 11)
    assert kv.describe(right).tokens == (1, 2, 3, 20)
    assert kv.describe(parent).tokens == (1, 2, 3)
    assert len({kv.pages(c)[0] for c in (parent, left, right)}) == 3


def test_a_snapshot_outlives_its_context_and_opens_as_a_fork() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    kv.ok(ev.SaveContext, context=context, name="greeting")
    kv.ok(ev.DestroyContext, context=context)
    opened = int(kv.ok(ev.OpenContext, "b", name="greeting").context)
    assert kv.describe(opened, "b").tokens == (1, 2, 3, 4, 5)
    assert all(kv.pool.owners(p) == 2 for p in kv.pages(opened))
    kv.write(opened, [6], "b")
    again = int(kv.ok(ev.OpenContext, "c", name="greeting").context)
    assert kv.describe(again, "c").tokens == (1, 2, 3, 4, 5)


def test_take_consumes_the_snapshot_and_delete_frees_it() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    kv.ok(ev.SaveContext, context=context, name="x")
    kv.ok(ev.SaveContext, context=context, name="y")
    taken = int(kv.ok(ev.OpenContext, name="x", take=True).context)
    assert kv.describe(taken).tokens == (1, 2, 3, 4, 5)
    assert kv.refused(ev.OpenContext, name="x").kind == "no_such_snapshot"
    kv.ok(ev.DeleteSnapshot, name="y")
    assert kv.refused(ev.DeleteSnapshot, name="y").kind == "no_such_snapshot"
    kv.ok(ev.DestroyContext, context=context)
    kv.ok(ev.DestroyContext, context=taken)
    assert kv.pool.free == 32


def test_snapshot_names_are_unique_per_user() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1])
    kv.ok(ev.SaveContext, context=context, name="n", user="ann")
    again = kv.refused(ev.SaveContext, context=context, name="n", user="ann")
    assert again.kind == "snapshot_exists"
    kv.ok(ev.SaveContext, context=context, name="n", user="bob")
    assert kv.refused(ev.OpenContext, name="n", user="cat").kind == "no_such_snapshot"
    kv.ok(ev.DeleteSnapshot, name="n", user="ann")
    assert kv.core.statistics().snapshots == 1


def test_releasing_a_requester_destroys_its_contexts_but_not_its_snapshots() -> None:
    kv = Kv()
    mine, theirs = kv.create("a"), kv.create("b")
    kv.write(mine, [1, 2])
    kv.write(theirs, [3], "b")
    kv.ok(ev.SaveContext, context=mine, name="keep")
    kv.ok(ev.ReleaseRequester, "a")
    assert set(kv.core.contexts) == {theirs}
    assert kv.core.statistics().snapshots == 1


def test_truncate_within_a_page_keeps_the_page() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5, 6])
    kv.ok(ev.TruncateContext, context=context, count=1)
    assert kv.describe(context).tokens == (1, 2, 3, 4, 5)
    assert kv.submit(context, [9]).positions == (5,)


def test_truncate_across_a_page_boundary_returns_pages() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, list(range(1, 11)))
    kv.ok(ev.TruncateContext, context=context, count=7)
    assert kv.describe(context).pages == 1 and kv.pool.free == 31
    kv.ok(ev.TruncateContext, context=context, count=3)
    assert kv.describe(context).tokens == () and kv.pool.free == 32


def test_truncate_refuses_more_tokens_than_the_context_has() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2])
    failed = kv.refused(ev.TruncateContext, context=context, count=3)
    assert failed.kind == "invalid" and "3 of 2" in failed.message


def test_writing_after_truncating_into_a_shared_committed_page_copies_it() -> None:
    kv = Kv()
    parent = kv.create()
    kv.write(parent, [1, 2, 3, 4, 5, 6, 7, 8])
    child = kv.fork(parent)
    shared = kv.pages(parent)[1]
    kv.ok(ev.TruncateContext, context=child, count=2)
    request = kv.submit(child, [60, 70])
    assert request.copies == (PageCopy(src=shared, dst=request.pages[1]),)
    kv.apply(request)
    assert kv.describe(parent).tokens == (1, 2, 3, 4, 5, 6, 7, 8)
    assert kv.describe(child).tokens == (1, 2, 3, 4, 5, 6, 60, 70)


def test_writing_after_truncating_a_committed_page_of_ones_own_copies_it() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4])
    committed = kv.pages(context)[0]
    kv.ok(ev.TruncateContext, context=context, count=1)
    request = kv.submit(context, [9])
    assert request.copies == (PageCopy(src=committed, dst=request.pages[0]),)
    kv.apply(request)
    assert kv.pool.free == 31


def test_truncating_nothing_changes_nothing() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3])
    before = kv.core.state()
    kv.ok(ev.TruncateContext, context=context, count=0)
    assert kv.core.state() == before


def test_truncating_drops_the_masks_of_the_pages_it_removes() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, list(range(1, 10)))
    kv.ok(ev.MaskPages, context=context, pages=(0, 1, 2))
    kv.ok(ev.TruncateContext, context=context, count=5)
    assert kv.describe(context).masked_pages == (0,)
    kv.write(context, [5, 6])
    assert kv.submit(context, [7]).masked_pages == (0,)


def test_masked_pages_reach_the_placed_request() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, list(range(1, 10)))
    kv.ok(ev.MaskPages, context=context, pages=(0, 2))
    assert kv.submit(context, [1]).masked_pages == (0, 2)


def test_unmasking_shows_pages_again_and_bad_indices_are_named() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, list(range(1, 10)))
    kv.ok(ev.MaskPages, context=context, pages=(0, 1))
    kv.ok(ev.MaskPages, context=context, pages=(0,), masked=False)
    assert kv.describe(context).masked_pages == (1,)
    failed = kv.refused(ev.MaskPages, context=context, pages=(1, 3, -1))
    assert failed.kind == "invalid" and "[3, -1]" in failed.message


def test_contexts_that_write_the_same_full_pages_end_up_sharing_them() -> None:
    kv = Kv()
    first, second = kv.create(), kv.create()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    running = kv.submit(first, prompt)
    request = kv.submit(second, prompt)
    kv.apply(running)
    kv.apply(request)
    assert request.pages[:2] != tuple(kv.pages(first)[:2])
    assert kv.pages(second)[:2] == kv.pages(first)[:2]
    assert kv.pages(second)[2] != kv.pages(first)[2]
    assert kv.core.statistics().shared_page_hits == 2
    assert kv.pool.free == 32 - 4


def test_a_different_position_is_a_different_page() -> None:
    kv = Kv()
    first, second = kv.create(), kv.create()
    kv.write(first, [1, 2, 3, 4])
    kv.apply(kv.submit(second, [1, 2, 3, 4], positions=(1, 2, 3, 4)))
    assert kv.pages(first) != kv.pages(second)
    assert kv.core.statistics().shared_page_hits == 0


def test_contexts_share_committed_pages_only_under_the_same_attention_masks() -> None:
    kv = Kv()
    causal = ((1,), (2,), (3,), (4,))
    own_token_only = ((0, 1), (1, 1), (2, 1), (3, 1))
    first, second, third = kv.create(), kv.create(), kv.create()
    kv.apply(kv.submit(first, [1, 2, 3, 4], attention_masks=causal))
    kv.apply(kv.submit(second, [1, 2, 3, 4], attention_masks=own_token_only))
    assert kv.pages(first) != kv.pages(second)
    assert kv.core.statistics().shared_page_hits == 0
    kv.apply(kv.submit(third, [1, 2, 3, 4], attention_masks=causal))
    assert kv.pages(third) == kv.pages(first)


def test_different_tokens_at_the_same_positions_are_different_pages() -> None:
    kv = Kv()
    first, second = kv.create(), kv.create()
    kv.write(first, [1, 2, 3, 4])
    kv.write(second, [1, 2, 3, 5])
    assert kv.pages(first) != kv.pages(second)
    assert kv.core.statistics().shared_page_hits == 0


def test_a_page_is_shared_only_when_every_page_before_it_matches_too() -> None:
    kv = Kv()
    first, second = kv.create(), kv.create()
    kv.write(first, [1, 2, 3, 4, 5, 6, 7, 8])
    kv.write(second, [9, 2, 3, 4, 5, 6, 7, 8])
    assert kv.pages(first)[1] != kv.pages(second)[1]
    assert kv.core.statistics().shared_page_hits == 0


def test_a_full_page_is_shared_whatever_follows_it() -> None:
    kv = Kv()
    first, second = kv.create(), kv.create()
    running = kv.submit(first, [1, 2, 3, 4, 5])
    kv.apply(kv.submit(second, [1, 2, 3, 4, 9], positions=(0, 1, 2, 3, 10)))
    kv.apply(running)
    assert kv.pages(second)[0] == kv.pages(first)[0]
    assert kv.core.statistics().shared_page_hits == 1


def test_pages_written_under_different_masked_pages_are_not_shared() -> None:
    kv = Kv()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    contexts = [kv.create() for _ in range(3)]
    for context, masked in zip(contexts, [(0,), (1,), (0,)], strict=True):
        kv.write(context, prompt)
        kv.ok(ev.MaskPages, context=context, pages=masked)
        kv.write(context, [9, 10, 11, 12])
    first, second, third = (kv.pages(c)[2] for c in contexts)
    assert first != second and third == first


def test_running_out_of_pages_fails_the_request_and_changes_nothing() -> None:
    kv = Kv(num_pages=3)
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    fork = kv.fork(context)
    before = kv.core.state()
    failed = kv.refused(ev.SubmitForward, context=fork, tokens=(1, 2, 3, 4))
    assert failed.kind == "out_of_pages"
    assert kv.core.state() == before
    kv.write(fork, [6, 7, 8])


def test_a_failed_pass_rolls_back_exactly() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5, 6])
    before = kv.core.state()
    kv.apply(kv.submit(context, list(range(7, 20))), ok=False)
    assert kv.core.state() == before


def test_a_failed_pass_on_a_fork_restores_the_shared_tail() -> None:
    kv = Kv()
    parent = kv.create()
    kv.write(parent, [1, 2, 3, 4, 5, 6])
    child = kv.fork(parent)
    before = kv.core.state()
    request = kv.submit(child, list(range(7, 16)))
    assert request.copies
    kv.apply(request, ok=False)
    assert kv.core.state() == before
    assert kv.pages(child) == kv.pages(parent)


def test_a_failed_pass_with_attention_masks_rolls_back_exactly() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2])
    before = kv.core.state()
    request = kv.submit(context, [3, 4], attention_masks=((0, 3), (4,)))
    kv.apply(request, ok=False)
    assert kv.core.state() == before


def test_truncation_and_roll_back_cut_the_attention_masks_a_context_records() -> None:
    kv = Kv()
    context = kv.create()
    chain = kv.core.contexts[context]
    kv.write(context, [1, 2])
    # The first mask covers the whole pass: it is kept over the slots its own token sees.
    kv.apply(kv.submit(context, [3, 4, 5], attention_masks=((2, 1, 2), (1, 1, 2), (5,))))
    assert chain.mask_runs == [(2, ((2, 1), (1, 1, 2), (5,)))]
    kv.apply(kv.submit(context, [6], attention_masks=((1, 5),)))
    run = (2, ((2, 1), (1, 1, 2), (5,), (1, 5)))
    assert chain.mask_runs == [run]
    before = kv.core.state()
    kv.apply(kv.submit(context, [7], attention_masks=((7,),)), ok=False)
    assert kv.core.state() == before and chain.mask_runs == [run]
    kv.write(context, [7, 8])
    kv.ok(ev.SaveContext, context=context, name="tree")
    kv.ok(ev.TruncateContext, context=context, count=5)
    assert chain.mask_runs == [(2, ((2, 1),))]
    assert kv.core.snapshots[("local", "tree")].mask_runs == [run]
    kv.ok(ev.TruncateContext, context=context, count=1)
    assert chain.mask_runs == []


def test_destroying_a_context_in_flight_frees_its_pages_after_the_pass() -> None:
    kv = Kv()
    context = kv.create()
    request = kv.submit(context, list(range(1, 10)))
    kv.ok(ev.DestroyContext, context=context)
    assert kv.pool.free == 32 - 3
    kv.apply(request)
    assert kv.pool.free == 32
    assert kv.core.statistics().passes_in_flight == 0


def test_reserving_allocates_the_pages_the_tokens_will_need_beyond_those_held() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5, 6])
    reserved = kv.reserve(context, 7)
    assert len(reserved) == 2 and not set(reserved) & set(kv.pages(context))
    assert (kv.describe(context).pages, kv.describe(context).reserved_pages) == (2, 2)
    assert kv.pool.free == 32 - 4
    assert kv.reserve(context, 5) == reserved
    assert kv.reserve(context, 0) == reserved
    assert kv.submit(context, [7]).pages == tuple(kv.pages(context))


def test_decoding_within_the_reserve_takes_its_pages_in_order_and_allocates_none() -> None:
    kv = Kv()
    context = kv.create()
    reserved = kv.reserve(context, 10)
    free = kv.pool.free
    assert kv.write(context, [1, 2, 3]).pages == tuple(reserved[:1])
    for token in range(4, 11):
        kv.write(context, [token])
        assert kv.pool.free == free
    assert kv.pages(context) == reserved and kv.describe(context).reserved_pages == 0
    kv.write(context, [11, 12, 13])
    assert kv.pool.free == free - 1


def test_a_pass_larger_than_the_reserve_takes_the_rest_from_the_pool() -> None:
    kv = Kv()
    context = kv.create()
    reserved = kv.reserve(context, 4)
    request = kv.write(context, list(range(1, 10)))
    assert request.pages[0] == reserved[0] and len(request.pages) == 3
    assert kv.pool.free == 32 - 3


def test_a_failed_pass_returns_the_pages_it_took_to_the_reserve() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2])
    kv.reserve(context, 8)
    before = kv.core.state()
    kv.apply(kv.submit(context, list(range(3, 20))), ok=False)
    assert kv.core.state() == before
    assert kv.describe(context).reserved_pages == 2


def test_a_forks_tail_copy_takes_its_fresh_page_from_the_reserve() -> None:
    kv = Kv()
    parent = kv.create()
    kv.write(parent, [1, 2, 3, 4, 5, 6])
    child = kv.fork(parent)
    [fresh] = kv.reserve(child, 1)
    free = kv.pool.free
    before = kv.core.state()
    request = kv.submit(child, [7])
    assert request.copies == (PageCopy(src=kv.pages(parent)[1], dst=fresh),)
    kv.apply(request, ok=False)
    assert kv.core.state() == before
    kv.write(child, [7])
    assert kv.pool.free == free and kv.pages(child)[1] == fresh


def test_reserving_while_a_pass_is_in_flight_counts_the_tokens_it_placed() -> None:
    kv = Kv()
    context = kv.create()
    request = kv.submit(context, [1, 2, 3, 4, 5])
    assert len(kv.reserve(context, 4)) == 1
    kv.apply(request, ok=False)
    assert kv.describe(context).reserved_pages == 1 and kv.pool.free == 32 - 1
    _assert_consistent(kv)


def test_truncating_keeps_the_reserve() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, list(range(1, 10)))
    reserved = kv.reserve(context, 4)
    assert len(reserved) == 1
    kv.ok(ev.TruncateContext, context=context, count=9)
    assert kv.core.contexts[context].reserved == reserved
    assert kv.pool.free == 32 - 1


def test_destroying_or_releasing_returns_reserved_pages_to_the_pool() -> None:
    kv = Kv()
    first, second = kv.create(), kv.create()
    kv.write(first, [1, 2])
    kv.reserve(first, 20)
    kv.reserve(second, 20)
    kv.ok(ev.DestroyContext, context=first)
    assert kv.pool.free == 32 - 5
    kv.ok(ev.ReleaseRequester)
    assert kv.pool.free == 32


def test_forks_and_snapshots_start_without_a_reserve() -> None:
    kv = Kv()
    parent = kv.create()
    kv.write(parent, [1, 2, 3, 4, 5])
    reserved = kv.reserve(parent, 12)
    child = kv.fork(parent)
    kv.ok(ev.SaveContext, context=parent, name="s")
    opened = int(kv.ok(ev.OpenContext, name="s").context)
    taken = int(kv.ok(ev.OpenContext, name="s", take=True).context)
    assert [kv.describe(c).reserved_pages for c in (parent, child, opened, taken)] == [3, 0, 0, 0]
    assert all(kv.pool.owners(p) == 1 for p in reserved)


def test_a_reservation_refused_for_lack_of_pages_changes_nothing() -> None:
    kv = Kv(num_pages=3)
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    before = kv.core.state()
    assert kv.refused(ev.ReserveTokens, context=context, count=8).kind == "out_of_pages"
    assert kv.refused(ev.ReserveTokens, context=context, count=-1).kind == "invalid"
    assert kv.refused(ev.ReserveTokens, "b", context=context, count=1).kind == "not_owner"
    assert kv.core.state() == before


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tokens": ()}, "at least one input token"),
        ({"tokens": (1, 100, -1)}, "[100, -1]"),
        ({"tokens": (1, 2), "positions": (0,)}, "1 positions for 2 tokens"),
        ({"tokens": (1,), "positions": (-1,)}, "positions must be in 0..2147483647"),
        ({"tokens": (1,), "positions": (2**63,)}, "positions must be in 0..2147483647"),
        ({"tokens": (1, 2), "slots": (SamplingSlot(index=2, op=Argmax()),)}, "index 2 outside"),
        ({"tokens": (1,), "slots": (SamplingSlot(index=0, op=LogProbs(tokens=(100,))),)}, "[100]"),
        ({"tokens": (1,), "logit_mask": (50, 49)}, "logit mask covers 99 entries, expected 100"),
        ({"tokens": (1,), "logit_mask": (101, -1)}, "logit mask has a negative run"),
        ({"tokens": (1,), "logit_bias": (LogitBias(mask=(99,), value=1.0),)}, "covers 99"),
        ({"tokens": (1,), "logit_bias": (LogitBias(mask=(100,), value=101.0),)}, "-100 to 100"),
        (
            {"tokens": (1,), "logit_bias": (LogitBias(mask=(100,), value=float("nan")),)},
            "logit bias 0",
        ),
        ({"tokens": (1,), "logit_bias": (LogitBias(mask=(100,), value=1.0),) * 65}, "at most 64"),
        (
            {"tokens": (1,), "penalty": Penalty(presence=3.0, frequency=0.0, tokens=())},
            "presence penalty",
        ),
        (
            {"tokens": (1,), "penalty": Penalty(presence=0.0, frequency=1.0, tokens=(100,))},
            "[100]",
        ),
        ({"tokens": (1, 2), "attention_masks": ((4,),)}, "1 attention masks for 2 tokens"),
        ({"tokens": (1, 2), "attention_masks": ((3,), (2, 3))}, "mask of token 1 covers 5"),
    ],
)
def test_a_malformed_pass_is_refused_as_invalid_with_the_reason(
    fields: dict[str, Any], words: str
) -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [7, 8])
    before = kv.core.state()
    failed = kv.refused(ev.SubmitForward, context=context, **fields)
    assert failed.kind == "invalid" and words in failed.message
    assert kv.core.state() == before


def test_only_the_owner_may_use_a_context() -> None:
    kv = Kv()
    context = kv.create("a")
    commands: list[tuple[Any, dict[str, Any]]] = [
        (ev.SubmitForward, {"tokens": (1,)}),
        (ev.ForkContext, {}),
        (ev.DestroyContext, {}),
        (ev.TruncateContext, {"count": 0}),
        (ev.DescribeContext, {}),
        (ev.MaskPages, {"pages": ()}),
        (ev.SaveContext, {"name": "n"}),
    ]
    for make, fields in commands:
        assert kv.refused(make, "b", context=context, **fields).kind == "not_owner"


def test_a_missing_context_is_named() -> None:
    kv = Kv()
    failed = kv.refused(ev.DescribeContext, context=99)
    assert failed.kind == "no_such_context" and "99" in failed.message


def test_a_late_or_repeated_pass_applied_is_ignored() -> None:
    kv = Kv()
    context = kv.create()
    request = kv.write(context, [1, 2])
    before = kv.core.state()
    kv.apply(request)
    kv.apply(request, ok=False)
    assert kv.core.state() == before


def test_a_page_size_of_one_holds_one_token_per_page() -> None:
    core = KvCore(num_pages=4, page_size=1, vocab_size=10)
    [(_, created)] = core.handle(ev.CreateContext(corr=1, requester="a"))
    submit = ev.SubmitForward(corr=2, requester="a", context=created.context, tokens=(1, 2, 3))
    [(_, placed)] = core.handle(submit)
    assert len(placed.request.pages) == 3 and core.pool.free == 1


def test_a_page_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        KvCore(num_pages=4, page_size=0, vocab_size=10)


def test_describe_reports_the_whole_context() -> None:
    kv = Kv()
    context = kv.create()
    kv.apply(kv.submit(context, [1, 2, 3, 4, 5], positions=(10, 11, 12, 13, 14)))
    kv.ok(ev.MaskPages, context=context, pages=(1,))
    kv.reserve(context, 4)
    [(_, info)] = kv.core.handle(ev.DescribeContext(corr=7, requester="a", context=context))
    assert info == ev.ContextInfo(
        corr=7,
        context=context,
        tokens=(1, 2, 3, 4, 5),
        positions=(10, 11, 12, 13, 14),
        next_position=15,
        pages=2,
        masked_pages=(1,),
        reserved_pages=1,
    )


def test_every_reply_carries_the_corr_of_its_command() -> None:
    kv = Kv(num_pages=4)
    context = kv.create()
    kv.write(context, [1, 2])
    commands = [
        ev.CreateContext(corr=101, requester="a"),
        ev.ForkContext(corr=102, requester="a", context=context),
        ev.SaveContext(corr=103, requester="a", context=context, name="s"),
        ev.OpenContext(corr=104, requester="a", name="s"),
        ev.DeleteSnapshot(corr=105, requester="a", name="s"),
        ev.ReserveTokens(corr=106, requester="a", context=context, count=1),
        ev.MaskPages(corr=107, requester="a", context=context, pages=(0,)),
        ev.TruncateContext(corr=108, requester="a", context=context, count=1),
        ev.DescribeContext(corr=109, requester="a", context=context),
        ev.SubmitForward(corr=110, requester="a", context=context, tokens=tuple(range(20))),
        ev.DestroyContext(corr=111, requester="a", context=context),
        ev.DescribeContext(corr=112, requester="a", context=context),
        ev.ReleaseRequester(corr=113, requester="a"),
    ]
    for command in commands:
        [(dst, reply)] = kv.core.handle(command)
        assert (dst, reply.corr) == ("a", command.corr), reply


def test_refusals_say_what_was_wrong() -> None:
    kv = Kv(num_pages=3)
    context = kv.create()
    kv.write(context, list(range(1, 10)))
    kv.ok(ev.SaveContext, context=context, name="n")
    refusals: list[tuple[Any, str, dict[str, Any], str]] = [
        (ev.DescribeContext, "b", {"context": context}, "belongs to another requester"),
        (ev.OpenContext, "a", {"name": "x"}, "no snapshot named 'x'"),
        (ev.SaveContext, "a", {"context": context, "name": "n"}, "snapshot named 'n' exists"),
        (ev.ReserveTokens, "a", {"context": context, "count": -1}, "cannot reserve -1 tokens"),
        (ev.MaskPages, "a", {"context": context, "pages": (3,)}, "[3] outside 0..2"),
        (ev.SubmitForward, "a", {"context": context, "tokens": (1,) * 3}, "free KV pages"),
        (ev.SubmitForward, "a", {"context": context, "tokens": (1,) * 4}, "at most 3"),
    ]
    for make, requester, fields, words in refusals:
        assert words in kv.refused(make, requester, **fields).message


@pytest.mark.parametrize(
    ("make", "fields", "verb"),
    [
        (ev.SubmitForward, {"tokens": (1,)}, "submit a pass to"),
        (ev.ForkContext, {}, "fork"),
        (ev.SaveContext, {"name": "n"}, "save"),
        (ev.TruncateContext, {"count": 1}, "truncate"),
        (ev.MaskPages, {"pages": (0,)}, "mask pages of"),
    ],
)
def test_a_busy_context_refusal_says_what_could_not_be_done(
    make: Any, fields: dict[str, Any], verb: str
) -> None:
    kv = Kv()
    context = kv.create()
    kv.submit(context, [1, 2])
    failed = kv.refused(make, context=context, **fields)
    assert failed.kind == "busy"
    assert failed.message == f"cannot {verb} a context while its pass is in flight"


def test_a_release_nobody_waits_for_answers_nothing() -> None:
    kv = Kv()
    kv.create()
    assert kv.core.handle(ev.ReleaseRequester(corr=1, requester="a", reply=False)) == []
    assert kv.core.contexts == {}


def test_an_unknown_event_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="unexpected event object"):
        Kv().core.handle(object())


def test_statistics_describe_the_page_table() -> None:
    kv = Kv()
    parent = kv.create()
    kv.write(parent, [1, 2, 3, 4, 5, 6])
    for _ in range(2):
        kv.write(kv.fork(parent), [7])
    kv.ok(ev.SaveContext, context=parent, name="s")
    kv.write(kv.create(), [1, 2, 3, 4])
    kv.submit(kv.create(), [1, 2, 3, 4, 5])
    assert kv.core.statistics() == KvStatistics(
        page_size=PAGE,
        pages_total=32,
        pages_free=32 - 5,
        contexts=5,
        snapshots=1,
        passes_in_flight=1,
        shared_page_hits=1,
        tail_copies=2,
        leases=0,
        prefix_cache="user",
        pages_cached=0,
        prefix_lookups=2,
        prefix_hits=1,
        prefix_hit_pages=1,
        prefix_hit_tokens=4,
        pages_evicted=0,
    )


# -- leases: a context's plain decodes on the fast path ----------------------------------------


def fast_decode(kv: Kv, context: int, tokens: Any = (6,), **fields: Any) -> ForwardRequest:
    """A pass that asks for a lease: a plain sampler at its last token, unless `fields` say
    otherwise."""
    fields.setdefault("slots", (SamplingSlot(index=len(tokens) - 1, op=TopP(p=0.9)),))
    fields.setdefault("fast", True)
    return kv.submit(context, tokens, **fields)


def lane_pass(kv: Kv, lease: Lease, token: int, step: int = 0, page: int = 0) -> list[Any]:
    """The fast path reporting that the `step`th token decoded on `lease` reached its program."""
    applied = LanePassApplied(
        lease=lease.lease,
        context=lease.context,
        corr=0,
        token=token,
        position=lease.next_position + step,
        page=page,
        staged=False,
        outputs=(),
    )
    return kv.core.handle(applied)


def test_a_plain_decode_asking_for_the_fast_path_is_granted_a_lease() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    reserved = kv.reserve(context, 4)
    placed = fast_decode(kv, context)
    assert placed.lease == Lease(
        lease=1,
        context=context,
        requester="a",
        pages=(*kv.pages(context), *reserved),
        owned=2,
        masked_pages=(),
        next_slot=6,
        next_position=6,
        op=TopP(p=0.9),
    )
    assert kv.core.statistics().leases == 1


@pytest.mark.parametrize(
    ("tokens", "fields"),
    [
        ((6,), {"fast": False}),
        ((6,), {"slots": (SamplingSlot(index=0, op=Argmax()),) * 2}),
        ((6, 7), {"slots": (SamplingSlot(index=0, op=Argmax()),)}),
        ((6,), {"slots": (SamplingSlot(index=0, op=Entropy()),)}),
        ((6,), {"slots": ()}),
        ((6,), {"attention_masks": ((6,),)}),
        ((6,), {"logit_mask": (100,)}),
        ((6,), {"logit_bias": (LogitBias(mask=(100,), value=1.0),)}),
        ((6,), {"penalty": Penalty(presence=0.1, frequency=0.1, tokens=(3,))}),
        ((6, 7, 8), {}),
    ],
    ids=[
        "not asked",
        "two slots",
        "slot before the end",
        "a probe",
        "no slot",
        "attention masks",
        "a logit mask",
        "a logit bias",
        "a penalty",
        "no room left",
    ],
)
def test_only_a_plain_decode_with_room_left_is_granted_a_lease(
    tokens: tuple[int, ...], fields: dict[str, Any]
) -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    placed = fast_decode(kv, context, tokens, **fields)
    assert placed.lease is None and kv.core.leases == {}


def test_a_lease_pins_its_pages_until_it_is_released() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    kv.reserve(context, 4)
    placed = fast_decode(kv, context)
    kv.apply(placed)
    kv.ok(ev.DestroyContext, context=context)
    assert kv.pool.free == 32 - 3
    assert placed.lease is not None
    released = LeaseReleased(lease=placed.lease.lease, context=context)
    assert kv.core.handle(released) == []
    assert kv.pool.free == 32 and kv.core.statistics().leases == 0
    assert kv.core.handle(released) == [] and kv.pool.free == 32


def test_lane_passes_extend_the_context_and_commit_its_full_pages() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3])
    [reserved] = kv.reserve(context, 4)
    placed = fast_decode(kv, context, (4,))
    kv.apply(placed)
    assert placed.lease is not None
    for step, token in enumerate((5, 6, 7, 8)):
        assert lane_pass(kv, placed.lease, token, step, page=reserved) == []
    info = kv.describe(context)
    assert info.tokens == tuple(range(1, 9)) and info.positions == tuple(range(8))
    assert (info.pages, info.reserved_pages) == (2, 0)
    other = kv.create()
    kv.write(other, range(1, 9))
    assert kv.pages(other) == kv.pages(context)


def test_leases_are_numbered_and_a_pass_granted_none_ends_the_last_one() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    first = fast_decode(kv, context)
    kv.apply(first)
    second = fast_decode(kv, context, (7,))
    kv.apply(second)
    assert first.lease is not None and second.lease is not None
    assert (first.lease.lease, second.lease.lease) == (1, 2)
    kv.apply(fast_decode(kv, context, (8,), slots=(SamplingSlot(index=0, op=Entropy()),)))
    before = kv.core.state()
    lane_pass(kv, second.lease, 9)
    assert kv.core.state() == before


@pytest.mark.parametrize(
    ("make", "fields"),
    [
        (ev.TruncateContext, {"count": 1}),
        (ev.MaskPages, {"pages": (0,)}),
        (ev.SaveContext, {"name": "n"}),
        (ev.ForkContext, {}),
        (ev.DestroyContext, {}),
    ],
)
def test_a_lane_pass_after_the_context_left_the_fast_path_is_ignored(
    make: Any, fields: dict[str, Any]
) -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, [1, 2, 3, 4, 5])
    placed = fast_decode(kv, context)
    kv.apply(placed)
    assert placed.lease is not None
    kv.ok(make, context=context, **fields)
    before = kv.core.state()
    assert lane_pass(kv, placed.lease, 7) == []
    assert kv.core.state() == before


def _churn_step(kv: Kv, rng: random.Random, saved: set[str], flights: list[ForwardRequest]) -> None:
    contexts = list(kv.core.contexts)
    action = rng.choice(
        [
            "create",
            "fork",
            "save",
            "open",
            "delete",
            "truncate",
            "mask",
            "submit",
            "reserve",
            "apply",
            "destroy",
        ]
    )
    context = rng.choice(contexts) if contexts else None
    if action == "create" or context is None:
        kv.create()
    elif action == "fork":
        kv.send(ev.ForkContext, context=context)
    elif action == "save":
        name = f"s{rng.randrange(6)}"
        kv.send(ev.SaveContext, context=context, name=name)
        saved.add(name)
    elif action == "open":
        kv.send(ev.OpenContext, name=f"s{rng.randrange(6)}", take=rng.random() < 0.3)
    elif action == "delete":
        kv.send(ev.DeleteSnapshot, name=f"s{rng.randrange(6)}")
    elif action == "truncate":
        length = len(kv.core.contexts[context].tokens)
        kv.send(ev.TruncateContext, context=context, count=rng.randrange(length + 1))
    elif action == "mask":
        count = len(kv.core.contexts[context].pages)
        pages = (rng.randrange(count),) if count else ()
        kv.send(ev.MaskPages, context=context, pages=pages, masked=rng.random() < 0.7)
    elif action == "submit":
        tokens = tuple(rng.randrange(3) for _ in range(rng.randint(1, 9)))
        [(_, out)] = kv.send(ev.SubmitForward, context=context, tokens=tokens)
        if isinstance(out, ScheduleForward):
            flights.append(out.request)
    elif action == "reserve":
        kv.send(ev.ReserveTokens, context=context, count=rng.randrange(12))
    elif action == "apply" and flights:
        kv.apply(flights.pop(rng.randrange(len(flights))), ok=rng.random() < 0.8)
    elif action == "destroy":
        kv.send(ev.DestroyContext, context=context)


def _assert_consistent(kv: Kv) -> None:
    """Every owner count is the number of chains holding the page; every pin is a pass's."""
    owners = [0] * kv.pool.num_pages
    pins = [0] * kv.pool.num_pages
    for chain in [*kv.core.contexts.values(), *kv.core.snapshots.values()]:
        assert len(chain.pages) == -(-len(chain.tokens) // PAGE)
        for page in [*chain.held(), *chain.reserved]:
            owners[page] += 1
    for flight in kv.core.in_flight.values():
        for page in flight.pinned:
            pins[page] += 1
        for page in flight.parked:
            owners[page] += 1
    assert kv.pool.state()[:2] == (tuple(owners), tuple(pins))
    assert kv.pool.free == sum(1 for o, p in zip(owners, pins, strict=True) if o == p == 0)


@pytest.mark.parametrize("seed", range(4))
def test_a_long_random_churn_returns_every_page(seed: int) -> None:
    rng = random.Random(seed)
    kv = Kv(num_pages=24, vocab_size=3)
    saved: set[str] = set()
    flights: list[ForwardRequest] = []
    for _ in range(400):
        _churn_step(kv, rng, saved, flights)
        _assert_consistent(kv)
    for request in flights:
        kv.apply(request)
    for context in list(kv.core.contexts):
        kv.ok(ev.DestroyContext, context=context)
    for name in saved:
        kv.send(ev.DeleteSnapshot, name=name)
    assert kv.core.statistics().snapshots == 0
    assert kv.pool.free == kv.pool.num_pages
    owners, pins, committed = kv.pool.state()
    assert (owners, pins) == ((0,) * 24, (0,) * 24)
    assert {page for page, _ in committed} == set(kv.pool.cache_order())
