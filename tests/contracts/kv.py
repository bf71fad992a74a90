"""The kv core contract: stories of fork, save, open, take, delete, truncate, destroy, shared
pages and copy-on-write tails, and random command sequences, with every invariant checked."""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from pie.events import kv as ev
from pie.events.forward import PageCopy
from pie.events.speculation import LeaseReleased
from tests.contracts.kv_churn import KvChurn
from tests.contracts.kv_invariants import (
    KvSession,
    MakeCore,
    assert_invariants,
    decode_slot,
    free_pages,
)

PAGE = 4
CHURN = settings(
    max_examples=120,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # The same sequences every run, so that which behaviours they reach (evictions included)
    # never depends on the draw.
    derandomize=True,
)


class KvCoreContract:
    """The kv core's invariants after each step of a story of commands.

    A core runs it with a test class that subclasses this one and provides `make_core`, a
    fixture returning a factory (num_pages, page_size, vocab_size keywords) of empty cores.
    The checks read what KvCore exposes for tests and replay: `handle`, `statistics()`,
    `state()`, `prefix_cache`, the chains in `contexts` and `snapshots` (pages, reserved,
    tokens, positions, hashes, written, masked, in_flight), the passes in `in_flight` (context,
    pinned, parked), `leases`, and its pool's `state()`, `cache_order()`, `evictions`, `owners()`,
    `free`, `num_pages` and `allocate()`.
    """

    @pytest.fixture
    def make_core(self) -> MakeCore:
        raise NotImplementedError("the runner provides a factory of empty cores")

    @pytest.fixture
    def kv(self, make_core: MakeCore) -> KvSession:
        return KvSession(make_core(num_pages=32, page_size=PAGE, vocab_size=100))

    def test_an_empty_core_has_every_page_free(self, kv: KvSession) -> None:
        assert_invariants(kv.core)
        assert free_pages(kv.core) == set(range(32))

    def test_fork_shares_every_page_and_counts_both_owners(self, kv: KvSession) -> None:
        parent = kv.create()
        kv.write(parent, [1, 2, 3, 4, 5, 6])
        free = kv.core.pool.free
        child = kv.ok(ev.ForkContext, context=parent).context
        assert kv.pages(child) == kv.pages(parent) and kv.core.pool.free == free
        assert all(kv.core.pool.owners(p) == 2 for p in kv.pages(parent))
        assert kv.tokens(child) == kv.tokens(parent)
        assert_invariants(kv.core)

    def test_writing_into_a_shared_tail_copies_it_and_leaves_the_other_chain_alone(
        self, kv: KvSession
    ) -> None:
        parent = kv.create()
        kv.write(parent, [1, 2, 3, 4, 5, 6])
        before = kv.pages(parent)
        child = kv.ok(ev.ForkContext, context=parent).context
        request = kv.submit(child, [7])
        assert request.copies == (PageCopy(src=before[1], dst=request.pages[1]),)
        assert_invariants(kv.core)
        kv.apply(request)
        assert kv.pages(parent) == before and kv.tokens(parent) == (1, 2, 3, 4, 5, 6)
        assert kv.pages(child)[0] == before[0] and kv.core.pool.owners(before[1]) == 1
        assert_invariants(kv.core)

    def test_full_pages_of_equal_content_are_committed_once(self, kv: KvSession) -> None:
        first, second, shifted = kv.create(), kv.create(), kv.create()
        prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
        kv.write(first, prompt)
        kv.write(second, prompt)
        kv.apply(kv.submit(shifted, prompt, positions=tuple(range(1, 10))))
        assert kv.pages(second)[:2] == kv.pages(first)[:2]
        assert kv.pages(second)[2] != kv.pages(first)[2]
        assert not set(kv.pages(shifted)) & set(kv.pages(first))
        assert_invariants(kv.core)

    def test_a_snapshot_outlives_its_context_and_opens_as_a_fork(self, kv: KvSession) -> None:
        context = kv.create()
        kv.write(context, [1, 2, 3, 4, 5])
        kv.ok(ev.SaveContext, context=context, name="s")
        kv.ok(ev.DestroyContext, context=context)
        assert_invariants(kv.core)
        opened = kv.ok(ev.OpenContext, "b", name="s").context
        assert kv.tokens(opened, "b") == (1, 2, 3, 4, 5)
        assert all(kv.core.pool.owners(p) == 2 for p in kv.pages(opened))
        assert_invariants(kv.core)

    def test_take_moves_a_snapshot_into_a_context_and_delete_frees_one(self, kv: KvSession) -> None:
        context = kv.create()
        kv.write(context, [1, 2, 3, 4, 5])
        kv.ok(ev.SaveContext, context=context, name="x")
        kv.ok(ev.SaveContext, context=context, name="y")
        kv.ok(ev.DestroyContext, context=context)
        taken = kv.ok(ev.OpenContext, name="x", take=True).context
        assert kv.failed(ev.OpenContext, name="x") == "no_such_snapshot"
        assert all(kv.core.pool.owners(p) == 2 for p in kv.pages(taken))
        kv.ok(ev.DeleteSnapshot, name="y")
        assert all(kv.core.pool.owners(p) == 1 for p in kv.pages(taken))
        kv.ok(ev.DestroyContext, context=taken)
        assert free_pages(kv.core) == set(range(32))
        assert_invariants(kv.core)

    def test_truncate_releases_the_pages_it_empties_and_keeps_the_rest(self, kv: KvSession) -> None:
        context = kv.create()
        kv.write(context, range(1, 11))
        pages = kv.pages(context)
        kv.ok(ev.TruncateContext, context=context, count=5)
        assert kv.pages(context) == pages[:2] and kv.tokens(context) == (1, 2, 3, 4, 5)
        assert free_pages(kv.core) >= {pages[2]}
        assert_invariants(kv.core)
        request = kv.submit(context, [9])
        assert request.copies == (PageCopy(src=pages[1], dst=request.pages[1]),)
        assert_invariants(kv.core)

    def test_destroying_a_context_in_flight_holds_its_pages_until_the_pass_ends(
        self, kv: KvSession
    ) -> None:
        context = kv.create()
        request = kv.submit(context, range(1, 10))
        kv.ok(ev.DestroyContext, context=context)
        assert not free_pages(kv.core) & set(request.pages)
        assert_invariants(kv.core)
        kv.apply(request)
        assert free_pages(kv.core) == set(range(32))
        assert_invariants(kv.core)

    def test_a_failed_pass_leaves_the_core_as_it_was(self, kv: KvSession) -> None:
        parent = kv.create()
        kv.write(parent, [1, 2, 3, 4, 5, 6])
        child = kv.ok(ev.ForkContext, context=parent).context
        kv.ok(ev.ReserveTokens, context=child, count=3)
        before = kv.core.state()
        request = kv.submit(child, range(7, 16))
        assert request.copies
        kv.apply(request, ok=False)
        assert kv.core.state() == before
        assert_invariants(kv.core)

    def test_a_pass_refused_for_lack_of_pages_changes_nothing(self, make_core: MakeCore) -> None:
        kv = KvSession(make_core(num_pages=3, page_size=PAGE, vocab_size=100))
        context = kv.create()
        kv.write(context, [1, 2, 3, 4, 5])
        fork = kv.ok(ev.ForkContext, context=context).context
        before = kv.core.state()
        assert kv.failed(ev.SubmitForward, context=fork, tokens=(1, 2, 3, 4)) == "out_of_pages"
        assert kv.core.state() == before
        assert_invariants(kv.core)

    def test_a_lease_pins_its_pages_until_released(self, kv: KvSession) -> None:
        context = kv.create()
        kv.ok(ev.ReserveTokens, context=context, count=8)
        request = kv.submit(context, [1, 2, 3], slots=decode_slot(3), fast=True)
        assert request.lease is not None
        kv.apply(request)
        kv.ok(ev.DestroyContext, context=context)
        assert not free_pages(kv.core) & set(request.lease.pages)
        assert_invariants(kv.core)
        kv.core.handle(LeaseReleased(lease=request.lease.lease, context=context))
        assert free_pages(kv.core) == set(range(32))
        assert_invariants(kv.core)

    def test_random_command_sequences_keep_every_invariant(self, make_core: MakeCore) -> None:
        """With pages of 1 token (equal pages everywhere) and of 2 and 4 (partial tails), under
        the default prefix cache scope (per user), and under the other two."""
        seen: Counter[str] = Counter()
        runs = [(1, "user"), (2, "user"), (4, "user"), (2, "global"), (2, "off")]
        for page_size, scope in runs:
            machine = partial(KvChurn, make_core, page_size, seen, scope)
            run_state_machine_as_test(machine, settings=CHURN)  # type: ignore[arg-type]
        reached = ("tail copies", "shared page hits", "leases", "out_of_pages", "prefix hits")
        assert all(seen[what] > 0 for what in reached + ("evictions",)), seen
