"""What holds of a kv core after any sequence of commands, as assertions over what the core
exposes, and a session that sends it commands the way requesters do."""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from pie.actors.kv import KvCore
from pie.events import kv as ev
from pie.events.batching import ScheduleForward
from pie.events.forward import ForwardRequest
from pie.events.sampling import Argmax, SamplingSlot

MakeCore = Callable[..., KvCore]
"""Called with num_pages, page_size and vocab_size (keywords), and prefix_cache when a test
picks the scope; returns an empty core."""


def _counts(pages: Iterable[int], num_pages: int) -> tuple[int, ...]:
    counter = Counter(pages)
    return tuple(counter[p] for p in range(num_pages))


def allocation_order(core: KvCore) -> list[int]:
    """Every page the pool would hand out, in the order it would, read from a copy so the core
    is untouched."""
    pool = copy.deepcopy(core.pool)
    return pool.allocate(pool.free)


def free_pages(core: KvCore) -> set[int]:
    """The pages the pool would hand out next (cached pages included)."""
    return set(allocation_order(core))


def assert_page_accounting(core: KvCore) -> None:
    """Owners are the chains and snapshots holding a page (reserve included) and the passes in
    flight holding reserved pages they made needless, pins are the passes in flight and the
    leases, and a page is free exactly when it has neither."""
    num_pages = core.pool.num_pages
    owners, pins, committed = core.pool.state()
    chains = [*core.contexts.values(), *core.snapshots.values()]
    owned = [p for ch in chains for p in [*ch.pages, *ch.reserved]]
    owned += [p for flight in core.in_flight.values() for p in flight.parked]
    assert owners == _counts(owned, num_pages)
    pinned = [p for flight in core.in_flight.values() for p in flight.pinned]
    pinned += [p for pages in core.leases.values() for p in pages]
    assert pins == _counts(pinned, num_pages)
    held = {p for p in range(num_pages) if owners[p] or pins[p]}
    free = free_pages(core)
    assert not free & held, f"pages {sorted(free & held)} are free and referenced"
    assert len(free) + len(held) == num_pages == core.statistics().pages_total
    assert core.statistics().pages_free == len(free)
    assert_cached_pages(core)


def assert_cached_pages(core: KvCore) -> None:
    """A free page keeps its content hash exactly when it is cached (never with the cache off);
    allocation takes every empty page before the first cached one, then the cached ones least
    recently released first."""
    owners, pins, committed = core.pool.state()
    cached = core.pool.cache_order()
    unheld = {page for page, _ in committed if not owners[page] and not pins[page]}
    assert set(cached) == unheld, "a free page kept its content hash outside the cache"
    assert not cached or core.prefix_cache != "off"
    order = allocation_order(core)
    assert tuple(order[len(order) - len(cached) :]) == cached
    stats = core.statistics()
    assert (stats.pages_cached, stats.pages_evicted) == (len(cached), core.pool.evictions)
    assert stats.prefix_hit_tokens == stats.prefix_hit_pages * core.page_size
    assert stats.prefix_hits <= stats.prefix_lookups


def assert_chains_agree_with_the_pool(core: KvCore) -> None:
    """Each chain's shape follows its tokens, and every page it committed is the one page the
    pool holds under that content hash."""
    size = core.page_size
    _, _, committed = core.pool.state()
    hash_of = dict(committed)
    assert len(set(hash_of.values())) == len(hash_of), "two pages committed under one hash"
    for chain in [*core.contexts.values(), *core.snapshots.values()]:
        assert len(chain.pages) == -(-len(chain.tokens) // size)
        assert len(chain.positions) == len(chain.tokens)
        assert chain.written <= len(chain.tokens)
        assert len(chain.hashes) == chain.written // size
        assert [hash_of.get(p) for p in chain.pages[: len(chain.hashes)]] == chain.hashes
        assert len({*chain.pages, *chain.reserved}) == len(chain.pages) + len(chain.reserved)
        assert all(core.pool.owners(p) == 1 and p not in hash_of for p in chain.reserved)
        assert chain.masked <= set(range(len(chain.pages)))
    for snapshot in core.snapshots.values():
        assert (snapshot.in_flight, snapshot.reserved) == (None, [])


def assert_flights_and_statistics(core: KvCore) -> None:
    busy = {c: ch.in_flight for c, ch in core.contexts.items() if ch.in_flight is not None}
    assert all(core.in_flight[corr].context == c for c, corr in busy.items())
    stats = core.statistics()
    assert (stats.contexts, stats.snapshots) == (len(core.contexts), len(core.snapshots))
    assert (stats.passes_in_flight, stats.leases) == (len(core.in_flight), len(core.leases))


def assert_invariants(core: KvCore) -> None:
    """Everything that holds after any sequence of commands."""
    assert_page_accounting(core)
    assert_chains_agree_with_the_pool(core)
    assert_flights_and_statistics(core)


def assert_writes_are_private(core: KvCore, request: ForwardRequest) -> None:
    """A placed pass writes only pages that its context alone owns and nobody has committed;
    a page it copies from stays pinned until the pass ends."""
    size = core.page_size
    committed = {page for page, _ in core.pool.state()[2]}
    written = {request.pages[slot // size] for slot in range(request.kv_start, request.kv_len)}
    assert all(core.pool.owners(p) == 1 and p not in committed for p in written)
    assert {c.dst for c in request.copies} <= written
    pins = core.pool.state()[1]
    assert all(pins[c.src] >= 1 for c in request.copies)


class KvSession:
    """One core and the corr numbers of the requesters talking to it."""

    def __init__(self, core: KvCore) -> None:
        self.core = core
        self._corr = itertools.count(1)

    def ask(self, make: Any, requester: str = "a", **fields: Any) -> Any:
        """The reply to one command (a placed pass for a SubmitForward that was accepted)."""
        outputs = self.core.handle(make(corr=next(self._corr), requester=requester, **fields))
        [(_, reply)] = outputs
        return reply.request if isinstance(reply, ScheduleForward) else reply

    def ok(self, make: Any, requester: str = "a", **fields: Any) -> Any:
        reply = self.ask(make, requester, **fields)
        assert not isinstance(reply, ev.RequestFailed), reply
        return reply

    def failed(self, make: Any, requester: str = "a", **fields: Any) -> str:
        reply = self.ask(make, requester, **fields)
        assert isinstance(reply, ev.RequestFailed), reply
        return str(reply.kind)

    def create(self, requester: str = "a") -> int:
        return int(self.ok(ev.CreateContext, requester).context)

    def submit(self, context: int, tokens: Iterable[int], **fields: Any) -> ForwardRequest:
        request: ForwardRequest = self.ok(
            ev.SubmitForward, context=context, tokens=tuple(tokens), **fields
        )
        assert_writes_are_private(self.core, request)
        return request

    def apply(self, request: ForwardRequest, ok: bool = True) -> None:
        applied = ev.PassApplied(corr=request.corr, context=request.context, ok=ok)
        assert self.core.handle(applied) == []

    def write(self, context: int, tokens: Iterable[int]) -> ForwardRequest:
        request = self.submit(context, tokens)
        self.apply(request)
        return request

    def tokens(self, context: int, requester: str = "a") -> tuple[int, ...]:
        return tuple(self.ok(ev.DescribeContext, requester, context=context).tokens)

    def pages(self, context: int) -> list[int]:
        return list(self.core.contexts[context].pages)


def decode_slot(n: int) -> tuple[SamplingSlot, ...]:
    """A token sampler at the last of n tokens: what a pass needs to be granted a lease."""
    return (SamplingSlot(index=n - 1, op=Argmax()),)
