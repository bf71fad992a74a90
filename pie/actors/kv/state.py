"""The kv core's state: the page pool, contexts and snapshots as page chains, passes in flight
and leases; the lookups and page edits every part of the core uses, and what it reports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pie.actors.kv.context import RELEASED, Chain, InFlight
from pie.actors.kv.pages import PagePool, salted
from pie.actors.kv.prefix import PrefixCache
from pie.actors.kv.quotas import Quotas
from pie.actors.kv.statistics import KvStatistics
from pie.actors.kv.validation import OutputLimits, RequestError
from pie.actors.kv.window import model_window

Output = tuple[str, Any]


class KvState:
    """What the kv core knows, and the edits both placing passes and context commands make."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        vocab_size: int,
        data_plane: str = "inference",
        prefix_cache: str = "user",
        quotas: Quotas | None = None,
        outputs: OutputLimits | None = None,
        sliding_window: int | None = None,
        adapters: Sequence[str] = (),
        context_ids: tuple[int, int] = (1, 1),
        model: str = "",
        elsewhere: Callable[[tuple[str, str]], str | None] | None = None,
        directory: str | None = None,
    ) -> None:
        """With several models, each has its own kv core: `context_ids` (first, step) keeps their
        context ids apart (model k of n: (k + 1, n)), `model` names this one, and `elsewhere`
        says which other model holds a snapshot (user, name) this core lacks, so that opening it
        here is refused in those words (None: one model)."""
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.model_window = model_window(sliding_window, page_size)
        """Every pass that names no window of its own gets this one: with a model whose
        every layer slides, the pages that left all windows are released."""
        self.adapters = frozenset(adapters)
        """The LoRA adapters the driver loaded: a pass naming another is refused."""
        self.data_plane = data_plane
        """Where placed requests go (the inference actor, the data plane's face)."""
        self.pool = PagePool(num_pages, retain=prefix_cache != "off")
        self.prefix = PrefixCache(prefix_cache, self.pool, page_size)
        self.quotas = quotas or Quotas.unlimited(num_pages)
        self.outputs = outputs or OutputLimits()
        self.contexts: dict[int, Chain] = {}
        self.snapshots: dict[tuple[str, str], Chain] = {}
        self.in_flight: dict[int, InFlight] = {}
        self._next_context, self._context_step = context_ids
        self.model = model
        self._elsewhere = elsewhere
        self.directory = directory
        """On a clustered node, the address of the cluster's directory of named snapshots: an
        open or delete of a snapshot no model here holds goes there to be answered."""
        self._shared_hits = 0
        self._tail_copies = 0
        self._released = 0
        self.leases: dict[int, list[int]] = {}
        """The pages each outstanding lease pins."""
        self._next_lease = 1

    def _owned(self, context: int, requester: str) -> Chain:
        chain = self.contexts.get(context)
        if chain is None:
            raise RequestError("no_such_context", f"context {context} does not exist")
        if chain.owner != requester:
            raise RequestError("not_owner", f"context {context} belongs to another requester")
        return chain

    def _snapshot(self, key: tuple[str, str]) -> Chain:
        snapshot = self.snapshots.get(key)
        if snapshot is None:
            other = self._elsewhere(key) if self._elsewhere is not None else None
            if other is not None:
                raise RequestError(
                    "wrong_model",
                    f"snapshot {key[1]!r} holds the KV of model {other!r}, not {self.model!r}: "
                    f"open it with model {other!r}",
                )
            raise RequestError("no_such_snapshot", f"no snapshot named {key[1]!r}")
        return snapshot

    @staticmethod
    def _quiet(chain: Chain, verb: str) -> None:
        if chain.in_flight is not None:
            raise RequestError("busy", f"cannot {verb} a context while its pass is in flight")

    def _pages_for(self, length: int) -> int:
        return -(-length // self.page_size)

    def _release_chain(self, pages: list[int]) -> None:
        """Releases a run of a chain's pages from its end, so that the pages that become cached
        are evicted deepest first: a cached page is only found through the pages before it."""
        self.pool.release(reversed(pages))

    def _mask(self, chain: Chain, pages: tuple[int, ...], masked: bool) -> None:
        # The pass in flight was placed under the old mask; its pages must be hashed under it.
        self._quiet(chain, "mask pages of")
        chain.lease = None
        bad = [p for p in pages if not 0 <= p < len(chain.pages)]
        if bad:
            raise RequestError("invalid", f"page indices {bad} outside 0..{len(chain.pages) - 1}")
        if not masked and (gone := [p for p in pages if chain.pages[p] == RELEASED]):
            raise RequestError("invalid", f"pages {gone} were released: their KV is gone")
        chain.masked = chain.masked | set(pages) if masked else chain.masked - set(pages)
        chain.salt = salted(chain.salt, repr(sorted(chain.masked)))

    def _release(self, chain: Chain, pages: tuple[int, ...] | list[int]) -> None:
        """Masks the pages for good and gives their KV back to the pool (checked already)."""
        fresh = sorted({p for p in pages if chain.pages[p] != RELEASED})
        if not fresh:
            return
        self._mask(chain, tuple(fresh), True)
        self.pool.release(chain.pages[p] for p in fresh)
        for p in fresh:
            chain.pages[p] = RELEASED
        self._released += len(fresh)

    @property
    def prefix_cache(self) -> str:
        """The prefix cache's scope: "off", "user" or "global"."""
        return self.prefix.scope

    def statistics(self) -> KvStatistics:
        return KvStatistics(
            page_size=self.page_size,
            pages_total=self.pool.num_pages,
            pages_free=self.pool.free,
            contexts=len(self.contexts),
            snapshots=len(self.snapshots),
            passes_in_flight=len(self.in_flight),
            shared_page_hits=self._shared_hits,
            tail_copies=self._tail_copies,
            pages_released=self._released,
            leases=len(self.leases),
            prefix_cache=self.prefix.scope,
            pages_cached=self.pool.cached,
            prefix_lookups=self.prefix.lookups,
            prefix_hits=self.prefix.hits,
            prefix_hit_pages=self.prefix.hit_pages,
            prefix_hit_tokens=self.prefix.hit_pages * self.page_size,
            pages_evicted=self.pool.evictions,
        )

    def state(self) -> tuple[object, ...]:
        """Everything that defines the page table, for exact comparison (replay)."""
        return (
            self.pool.state(),
            tuple(sorted((c, ch.state()) for c, ch in self.contexts.items())),
            tuple(sorted((k, s.state()) for k, s in self.snapshots.items())),
            tuple(sorted(self.in_flight)),
            self._next_context,
            tuple(sorted((k, tuple(v)) for k, v in self.leases.items())),
            self.pool.cache_order(),
        )
