"""Prefix caching in the kv core: a pass whose leading full pages are committed already attaches
them and sends only the rest of its tokens; pages whose last owner left stay cached until the
allocator needs them; scopes decide whose pages a context may reuse."""

from __future__ import annotations

from typing import Any

import pytest

from pie.actors.kv import KvCore
from pie.events import kv as ev
from pie.events.forward import ForwardRequest
from pie.events.sampling import Argmax, Distribution, SamplingSlot
from tests.contracts.kv_invariants import KvSession, assert_invariants

pytestmark = pytest.mark.unit

PAGE = 4
PROMPT = (5, 6, 7, 8, 9, 10, 11, 12, 13, 14)
"""Two full pages and two tokens of a third."""


class Cache(KvSession):
    """A core with the prefix cache in one scope, spoken to as users' requesters."""

    def __init__(self, num_pages: int = 32, prefix_cache: str = "user", page: int = PAGE) -> None:
        super().__init__(
            KvCore(num_pages=num_pages, page_size=page, vocab_size=100, prefix_cache=prefix_cache)
        )

    def context(self, user: str = "local", requester: str = "a") -> int:
        return int(self.ok(ev.CreateContext, requester, user=user).context)

    def pass_(self, context: int, tokens: Any, requester: str = "a", **fields: Any) -> Any:
        request = self.ok(
            ev.SubmitForward, requester, context=context, tokens=tuple(tokens), **fields
        )
        assert isinstance(request, ForwardRequest)
        assert_invariants(self.core)
        return request

    def fill(self, context: int, tokens: Any, requester: str = "a", **fields: Any) -> Any:
        request = self.pass_(context, tokens, requester, **fields)
        self.apply(request)
        assert_invariants(self.core)
        return request

    def stats(self) -> tuple[int, int, int, int]:
        """Lookups, hits, pages reused and tokens reused."""
        s = self.core.statistics()
        assert s.prefix_hit_tokens == s.prefix_hit_pages * PAGE
        return s.prefix_lookups, s.prefix_hits, s.prefix_hit_pages, s.prefix_hit_tokens


def last(n: int) -> tuple[SamplingSlot, ...]:
    return (SamplingSlot(index=n - 1, op=Argmax()),)


def test_the_same_prompt_again_attaches_the_committed_pages_and_computes_only_the_rest() -> None:
    kv = Cache()
    first = kv.context()
    kv.fill(first, PROMPT)
    second = kv.context()
    request = kv.pass_(second, PROMPT, slots=last(10))
    assert (request.tokens, request.positions, request.kv_start) == ((13, 14), (8, 9), 8)
    assert request.slots == (SamplingSlot(index=1, op=Argmax()),)
    assert request.pages[:2] == tuple(kv.pages(first)[:2]) and request.copies == ()
    assert all(kv.core.pool.owners(p) == 2 for p in request.pages[:2])
    assert kv.stats() == (2, 1, 2, 8)
    kv.apply(request)
    assert kv.tokens(second) == PROMPT and kv.core.contexts[second].written == 10
    assert_invariants(kv.core)


def test_skipping_stops_at_the_page_of_the_first_token_a_slot_reads() -> None:
    kv = Cache()
    kv.fill(kv.context(), PROMPT)
    probe = SamplingSlot(index=5, op=Distribution(k=3))
    slots = (SamplingSlot(index=9, op=Argmax()), probe)
    request = kv.pass_(kv.context(), PROMPT, slots=slots)
    assert request.kv_start == 4 and request.tokens == PROMPT[4:]
    assert [s.index for s in request.slots] == [5, 1]
    assert kv.stats() == (2, 1, 1, 4)


def test_every_lookup_and_every_reused_page_is_counted() -> None:
    kv = Cache()
    kv.fill(kv.context(), PROMPT)
    for _ in range(2):
        kv.pass_(kv.context(), PROMPT)
    assert kv.stats() == (3, 2, 4, 16)


def test_with_pages_of_one_token_a_pass_reuses_all_but_its_last_token() -> None:
    kv = Cache(page=1)
    kv.fill(kv.context(), (1, 2, 3))
    request = kv.pass_(kv.context(), (1, 2), slots=last(2))
    assert (request.tokens, request.kv_start, request.slots[0].index) == ((2,), 1, 0)


def test_a_slot_on_the_first_page_leaves_nothing_to_look_up() -> None:
    kv = Cache()
    kv.fill(kv.context(), PROMPT)
    request = kv.pass_(kv.context(), PROMPT, slots=(SamplingSlot(index=3, op=Argmax()),))
    assert request.kv_start == 0 and request.tokens == PROMPT
    assert kv.stats() == (1, 0, 0, 0)


def test_a_pass_always_computes_its_last_page_and_then_shares_it() -> None:
    kv = Cache()
    first = kv.context()
    kv.fill(first, PROMPT[:8])
    second = kv.context()
    request = kv.fill(second, PROMPT[:8])
    assert request.kv_start == 4 and request.tokens == PROMPT[4:8]
    assert kv.pages(second) == kv.pages(first)
    assert kv.core.statistics().shared_page_hits == 1


def test_a_context_looks_only_when_its_tokens_end_on_a_page_boundary() -> None:
    kv = Cache()
    kv.fill(kv.context(), PROMPT)
    ragged = kv.context()
    kv.fill(ragged, PROMPT[:2])
    assert kv.pass_(ragged, PROMPT[2:]).kv_start == 2
    aligned = kv.context()
    kv.fill(aligned, PROMPT[:4])
    request = kv.pass_(aligned, PROMPT[4:])
    assert request.kv_start == 8 and request.tokens == PROMPT[8:]
    assert kv.stats() == (2, 1, 1, 4)


def test_a_page_is_reused_only_when_every_page_before_it_matches() -> None:
    kv = Cache()
    first = kv.context()
    kv.fill(first, PROMPT)
    request = kv.pass_(kv.context(), (99, *PROMPT[1:]))
    assert request.kv_start == 0 and not set(request.pages) & set(kv.pages(first))
    shifted = kv.pass_(kv.context(), PROMPT, positions=tuple(range(1, 11)))
    assert shifted.kv_start == 0
    assert kv.stats() == (3, 0, 0, 0)


def test_reuse_follows_the_attention_masks_that_shaped_the_pages() -> None:
    kv = Cache()
    causal = tuple((i + 1,) for i in range(10))
    own_token = tuple((i, 1) if i else (1,) for i in range(10))
    kv.fill(kv.context(), PROMPT, attention_masks=causal)
    assert kv.pass_(kv.context(), PROMPT, attention_masks=own_token).kv_start == 0
    assert kv.pass_(kv.context(), PROMPT).kv_start == 0
    again = kv.pass_(kv.context(), PROMPT, attention_masks=causal)
    assert again.kv_start == 8 and again.attention_masks == causal[8:]


def test_pages_whose_last_owner_left_stay_cached_and_come_back() -> None:
    kv = Cache()
    first = kv.context()
    kv.fill(first, PROMPT)
    pages = kv.pages(first)
    kv.ok(ev.DestroyContext, context=first)
    assert kv.core.statistics().pages_cached == 2
    assert kv.core.pool.free == 32
    assert kv.core.pool.cache_order() == (pages[1], pages[0])
    assert_invariants(kv.core)
    request = kv.pass_(kv.context(), PROMPT)
    assert request.pages[:2] == tuple(pages[:2]) and request.kv_start == 8
    assert kv.core.statistics().pages_cached == 0


def test_a_snapshots_pages_are_reused_by_a_new_context_with_the_same_prompt() -> None:
    kv = Cache()
    saved = kv.context()
    kv.fill(saved, PROMPT)
    kv.ok(ev.SaveContext, context=saved, name="system")
    kv.ok(ev.DestroyContext, context=saved)
    fresh = kv.context()
    request = kv.pass_(fresh, PROMPT)
    snapshot = kv.core.snapshots[("local", "system")]
    assert request.pages[:2] == tuple(snapshot.pages[:2]) and request.kv_start == 8
    assert all(kv.core.pool.owners(p) == 2 for p in snapshot.pages[:2])


def test_a_page_still_pinned_by_a_destroyed_contexts_pass_can_be_reused() -> None:
    kv = Cache()
    first = kv.context()
    kv.fill(first, PROMPT[:8])
    running = kv.pass_(first, (1,))
    kv.ok(ev.DestroyContext, context=first)
    request = kv.pass_(kv.context(), PROMPT[:8] + (1,))
    assert request.pages[:2] == running.pages[:2] and request.kv_start == 8
    kv.apply(running)
    assert all(kv.core.pool.owners(p) == 1 for p in request.pages[:2])
    assert_invariants(kv.core)


def test_allocation_takes_empty_pages_first_then_evicts_the_least_recently_released() -> None:
    kv = Cache(num_pages=6)
    first, second = kv.context(), kv.context()
    kv.fill(first, PROMPT[:8])
    kv.fill(second, (1, 2, 3, 4, 5, 6, 7, 8))
    old, other = kv.pages(first), kv.pages(second)
    kv.ok(ev.DestroyContext, context=first)
    kv.ok(ev.DestroyContext, context=second)
    assert kv.core.pool.cache_order() == (old[1], old[0], other[1], other[0])
    taken = kv.fill(kv.context(), range(20, 32)).pages
    assert set(taken) == {4, 5, old[1]}
    assert kv.core.statistics().pages_evicted == 1
    request = kv.pass_(kv.context(), PROMPT[:8] + (1,))
    assert request.kv_start == 4 and request.pages[0] == old[0]


def test_a_pass_refused_for_lack_of_pages_leaves_the_cache_as_it_was() -> None:
    kv = Cache(num_pages=4)
    kv.fill(kv.context(), (90, 91, 92, 93))
    first = kv.context()
    kv.fill(first, PROMPT[:8])
    kv.ok(ev.DestroyContext, context=first)
    second = kv.context()
    before = kv.core.state()
    longer = PROMPT[:8] + (1, 2, 3, 4, 5, 6, 7, 8)
    refused = kv.ask(ev.SubmitForward, context=second, tokens=longer)
    assert refused.kind == "out_of_pages" and "1 of 4 free" in refused.message
    assert kv.core.state() == before and kv.stats() == (1, 0, 0, 0)
    request = kv.pass_(second, PROMPT[:8] + (1, 2, 3, 4))
    assert request.kv_start == 8 and kv.core.pool.free == 0


def test_a_failed_pass_gives_the_pages_it_reused_back_to_the_cache() -> None:
    kv = Cache()
    first = kv.context()
    kv.fill(first, PROMPT)
    kv.ok(ev.DestroyContext, context=first)
    second = kv.context()
    before = kv.core.contexts[second].state()
    request = kv.pass_(second, PROMPT)
    kv.apply(request, ok=False)
    assert kv.core.contexts[second].state() == before
    assert kv.core.statistics().pages_cached == 2
    assert_invariants(kv.core)
    assert kv.pass_(second, PROMPT).pages[:2] == request.pages[:2]


def test_reserved_pages_that_reused_pages_made_needless_are_given_back() -> None:
    kv = Cache()
    kv.fill(kv.context(), PROMPT)
    second = kv.context()
    kv.ok(ev.ReserveTokens, context=second, count=15)
    reserved = list(kv.core.contexts[second].reserved)
    free = kv.core.pool.free
    request = kv.pass_(second, PROMPT, slots=last(10))
    assert request.pages[2] == reserved[0]
    assert kv.core.contexts[second].reserved == reserved[1:2]
    assert kv.core.pool.free == free
    kv.apply(request)
    assert kv.core.pool.free == free + 2
    assert_invariants(kv.core)
    kv.fill(second, (1, 2, 3, 4, 5))
    assert kv.core.pool.free == free + 2
    assert kv.core.contexts[second].reserved == []


def test_a_pass_within_its_reserve_is_placed_when_the_pool_has_no_page_left() -> None:
    kv = Cache(num_pages=4)
    kv.fill(kv.context(), PROMPT[:8])
    second = kv.context()
    kv.ok(ev.ReserveTokens, context=second, count=8)
    assert kv.core.pool.free == 0
    request = kv.pass_(second, PROMPT[:8] + (1, 2, 3, 4))
    assert request.kv_start == 8 and kv.core.contexts[second].reserved == []
    kv.apply(request)
    assert kv.core.pool.free == 1


def test_a_failed_pass_puts_the_reserve_back_as_it_was() -> None:
    kv = Cache()
    kv.fill(kv.context(), PROMPT)
    second = kv.context()
    kv.ok(ev.ReserveTokens, context=second, count=15)
    before = kv.core.contexts[second].state()
    kv.apply(kv.pass_(second, PROMPT), ok=False)
    assert kv.core.contexts[second].state() == before
    assert_invariants(kv.core)


def test_destroying_a_context_in_flight_releases_its_needless_reserve_after_the_pass() -> None:
    kv = Cache()
    first = kv.context()
    kv.fill(first, PROMPT)
    kv.ok(ev.DestroyContext, context=first)
    second = kv.context()
    kv.ok(ev.ReserveTokens, context=second, count=12)
    request = kv.pass_(second, PROMPT)
    kv.ok(ev.DestroyContext, context=second)
    assert kv.core.pool.free < 32
    kv.apply(request)
    assert kv.core.pool.free == 32 and kv.core.statistics().pages_cached == 2
    assert_invariants(kv.core)


def test_under_the_user_scope_two_users_never_share_a_page() -> None:
    kv = Cache(prefix_cache="user")
    ann = kv.context("ann")
    kv.fill(ann, PROMPT)
    bob = kv.context("bob", "b")
    request = kv.fill(bob, PROMPT, "b")
    assert request.kv_start == 0 and not set(kv.pages(bob)) & set(kv.pages(ann))
    assert kv.core.statistics().shared_page_hits == 0
    again = kv.pass_(kv.context("ann", "b"), PROMPT, "b")
    assert again.kv_start == 8 and again.pages[:2] == tuple(kv.pages(ann)[:2])


def test_under_the_global_scope_every_context_shares() -> None:
    kv = Cache(prefix_cache="global")
    ann = kv.context("ann")
    assert kv.core.contexts[ann].salt == b""
    kv.fill(ann, PROMPT)
    request = kv.pass_(kv.context("bob", "b"), PROMPT, "b")
    assert request.kv_start == 8 and request.pages[:2] == tuple(kv.pages(ann)[:2])


def test_with_the_cache_off_nothing_is_looked_up_or_kept() -> None:
    kv = Cache(prefix_cache="off")
    first = kv.context()
    kv.fill(first, PROMPT)
    assert kv.pass_(kv.context(), PROMPT).kv_start == 0
    kv.ok(ev.DestroyContext, context=first)
    stats = kv.core.statistics()
    assert (stats.prefix_cache, stats.pages_cached, kv.stats()) == ("off", 0, (0, 0, 0, 0))


def test_forks_and_opened_snapshots_keep_their_users_scope() -> None:
    kv = Cache()
    ann = kv.context("ann")
    kv.fill(ann, PROMPT[:4])
    fork = int(kv.ok(ev.ForkContext, context=ann).context)
    kv.ok(ev.SaveContext, context=ann, name="s", user="ann")
    opened = int(kv.ok(ev.OpenContext, "b", name="s", user="ann").context)
    kv.fill(kv.context("ann"), PROMPT)
    for context, requester in ((fork, "a"), (opened, "b")):
        assert kv.pass_(context, PROMPT[4:], requester).kv_start == 8


def test_an_unknown_scope_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix_cache must be one of off, user, global"):
        KvCore(num_pages=4, page_size=PAGE, vocab_size=10, prefix_cache="team")
