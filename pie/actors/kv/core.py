"""The kv actor's pure core: every context command in, placed passes and replies out.

No trio here: `handle(event)` returns (destination, event) pairs, so tests and replay drive it
directly. A pass whose leading full pages are committed already (prefix caching) attaches them
and sends only the rest of its tokens to the driver.
"""

from __future__ import annotations

from typing import Any

from pie.actors.kv.context import RELEASED, Chain, InFlight
from pie.actors.kv.leases import lease_for
from pie.actors.kv.pages import OutOfPages, PagePool, chain_hash, salted
from pie.actors.kv.prefix import PrefixCache, park_surplus, skip_tokens
from pie.actors.kv.quotas import Quotas, check_growth, check_size, check_snapshot
from pie.actors.kv.statistics import KvStatistics
from pie.actors.kv.validation import OutputLimits, RequestError, validate_forward
from pie.actors.kv.window import Compactor, check_release, check_window, leaving
from pie.events import kv as ev
from pie.events.batching import ScheduleForward
from pie.events.forward import ForwardRequest, PageCopy
from pie.events.speculation import LanePassApplied, LanePassesApplied, Lease, LeaseReleased

Output = tuple[str, Any]


class KvCore:
    accepts = (ev.KvCommand, LanePassApplied, LanePassesApplied, LeaseReleased)
    """The kv mailbox: context commands, and the commits of passes run on the fast path."""

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
    ) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.data_plane = data_plane
        """Where placed requests go (the inference actor, the data plane's face)."""
        self.pool = PagePool(num_pages, retain=prefix_cache != "off")
        self.prefix = PrefixCache(prefix_cache, self.pool, page_size)
        self.quotas = quotas or Quotas.unlimited(num_pages)
        self.outputs = outputs or OutputLimits()
        self.contexts: dict[int, Chain] = {}
        self.snapshots: dict[tuple[str, str], Chain] = {}
        self.in_flight: dict[int, InFlight] = {}
        self._next_context = 1
        self._shared_hits = 0
        self._tail_copies = 0
        self._released = 0
        self.leases: dict[int, list[int]] = {}
        """The pages each outstanding lease pins."""
        self._next_lease = 1

    def handle(self, event: Any) -> list[Output]:
        try:
            return self._dispatch(event)
        except RequestError as err:
            return [
                (
                    event.requester,
                    ev.RequestFailed(corr=event.corr, kind=err.kind, message=str(err)),
                )
            ]
        except OutOfPages as err:
            failed = ev.RequestFailed(corr=event.corr, kind="out_of_pages", message=str(err))
            return [(event.requester, failed)]

    def _dispatch(self, event: Any) -> list[Output]:
        match event:
            case ev.SubmitForward():
                return [(self.data_plane, ScheduleForward(request=self._place(event)))]
            case ev.PassApplied():
                self._settle(event)
                return []
            case LanePassApplied():
                self._lane_pass(event)
                return []
            case LanePassesApplied():
                for applied in event.passes:
                    self._lane_pass(applied)
                return []
            case LeaseReleased():
                self.pool.unpin(self.leases.pop(event.lease, ()))
                return []
            case ev.CreateContext():
                salt = self.prefix.first_salt(event.user)
                chain = Chain(owner=event.requester, user=event.user, salt=salt)
                return self._created(event, chain)
            case ev.ForkContext():
                source = self._owned(event.context, event.requester)
                self._quiet(source, "fork")
                source.lease = None
                self.pool.share(source.held())
                return self._created(event, source.copy(event.requester))
            case ev.OpenContext():
                return self._open(event)
            case ev.SaveContext():
                return self._save(event)
            case ev.DeleteSnapshot():
                self._snapshot((event.user, event.name))
                self._delete_snapshot((event.user, event.name))
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.DropSnapshots():
                for key in [k for k in self.snapshots if k[0] == event.user]:
                    self._delete_snapshot(key)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.DestroyContext():
                self._owned(event.context, event.requester)
                self._drop(event.context)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.TruncateContext():
                self._truncate(self._owned(event.context, event.requester), event.count)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.ReserveTokens():
                self._reserve(self._owned(event.context, event.requester), event.count)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.MaskPages():
                self._mask(self._owned(event.context, event.requester), event.pages, event.masked)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.ReleasePages():
                chain = self._owned(event.context, event.requester)
                self._quiet(chain, "release pages of")
                check_release(chain, event.pages, self.page_size)
                self._release(chain, event.pages)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.DescribeContext():
                return [(event.requester, self._describe(event))]
            case ev.ReleaseRequester():
                for context in [
                    c for c, ch in self.contexts.items() if ch.owner == event.requester
                ]:
                    self._drop(context)
                return [(event.requester, ev.Done(corr=event.corr))] if event.reply else []
        raise TypeError(f"kv actor got an unexpected event {type(event).__name__}")

    # -- placing and settling passes -------------------------------------------------------

    def _place(self, event: ev.SubmitForward) -> ForwardRequest:
        chain = self._owned(event.context, event.requester)
        self._quiet(chain, "submit a pass to")
        validate_forward(event, len(chain.tokens), self.vocab_size, self.outputs)
        if event.window is not None:
            check_window(event.window)
            self._release(chain, leaving(chain, event.window, self.page_size))
        positions = event.positions
        if positions is None:
            start = chain.next_position()
            positions = tuple(range(start, start + len(event.tokens)))
        old_length = len(chain.tokens)
        old_salt = chain.salt
        salt = old_salt
        if event.attention_masks is not None:
            salt = salted(old_salt, repr(event.attention_masks))
        reuse = self.prefix.find(chain, event, positions, salt)
        reused = [page for page, _ in reuse or ()]
        total = self._pages_for(old_length + len(event.tokens))
        released = chain.released()
        check_size(self.quotas, old_length + len(event.tokens), total - len(released))
        needed = total - len(chain.pages) - len(reused)
        tail = self._tail_needing_copy(chain, old_length)
        count = needed + (1 if tail is not None else 0)
        # Checked before anything changes, so that a refused pass leaves the cache as it was.
        self.pool.check_room(count - len(chain.reserved), keep=reused)
        grow = max(count - len(chain.reserved), 0)
        check_growth(
            self.quotas, self.contexts.values(), chain, grow, reused, in_use=self.pool.in_use
        )
        self.prefix.attach(chain, reuse)
        added, from_reserve = self._take(chain, count)
        copies: tuple[PageCopy, ...] = ()
        replaced = None
        if tail is not None:
            replaced = (tail, chain.pages[tail])
            copies = (self._copy_tail(chain, tail, added.pop()),)
        chain.pages.extend(added)
        parked = park_surplus(chain, len(reused))
        chain.salt = salt
        chain.tokens.extend(event.tokens)
        chain.positions.extend(positions)
        chain.in_flight = event.corr
        pinned = chain.held()
        self.pool.pin(pinned)
        if replaced:
            pinned.append(replaced[1])
        lease = self._grant(event, chain) if event.fast else None
        self.in_flight[event.corr] = InFlight(
            context=event.context,
            old_length=old_length,
            pinned=pinned,
            added_pages=added,
            replaced_tail=replaced,
            old_salt=old_salt,
            from_reserve=from_reserve,
            reused=reused,
            parked=parked,
        )
        request = ForwardRequest(
            corr=event.corr,
            requester=event.requester,
            context=event.context,
            tokens=event.tokens,
            positions=tuple(positions),
            kv_start=old_length,
            pages=tuple(chain.pages),
            masked_pages=tuple(sorted(chain.masked)),
            attention_masks=event.attention_masks,
            logit_mask=event.logit_mask,
            logit_bias=event.logit_bias,
            penalty=event.penalty,
            slots=event.slots,
            copies=copies,
            lease=lease,
        )
        request = skip_tokens(request, len(reused) * self.page_size)
        return Compactor(released, self.page_size).request(request)

    def _grant(self, event: ev.SubmitForward, chain: Chain) -> Lease | None:
        chain.lease = None
        lease = lease_for(
            event, chain, self._next_lease, self.page_size, reserve=event.window is None
        )
        if lease is None:
            return None
        self._next_lease += 1
        pages = list(lease.pages)
        self.pool.pin(pages)
        self.leases[lease.lease] = pages
        chain.lease = lease.lease
        return lease

    def _lane_pass(self, event: LanePassApplied) -> None:
        """A pass run on the context's lease reached its program: the token is the context's."""
        chain = self.contexts.get(event.context)
        if chain is None or chain.lease != event.lease:
            return  # the context was destroyed or left the fast path after the pass ran
        length = len(chain.tokens)
        if length == len(chain.pages) * self.page_size:
            taken = chain.reserved.pop(0)
            assert taken == event.page, f"lease took page {event.page}, reserve gave {taken}"
            chain.pages.append(taken)
        chain.tokens.append(event.token)
        chain.positions.append(event.position)
        chain.written = len(chain.tokens)
        self._commit_full_pages(chain)

    def _take(self, chain: Chain, count: int) -> tuple[list[int], int]:
        """`count` pages for a pass, the chain's reserve first, and how many came from it."""
        from_reserve = min(count, len(chain.reserved))
        pages = self.pool.allocate(count - from_reserve)
        taken = chain.reserved[:from_reserve]
        del chain.reserved[:from_reserve]
        return taken + pages, from_reserve

    def _copy_tail(self, chain: Chain, tail: int, fresh: int) -> PageCopy:
        original = chain.pages[tail]
        # The original stays pinned as the copy's source until the pass ends; this chain no
        # longer owns it.
        self.pool.pin([original])
        self.pool.release([original])
        chain.pages[tail] = fresh
        self._tail_copies += 1
        return PageCopy(src=original, dst=fresh)

    def _pages_for(self, length: int) -> int:
        return -(-length // self.page_size)

    def _tail_needing_copy(self, chain: Chain, length: int) -> int | None:
        if length % self.page_size == 0:
            return None
        tail = length // self.page_size
        return None if self.pool.writable(chain.pages[tail]) else tail

    def _settle(self, event: ev.PassApplied) -> None:
        flight = self.in_flight.pop(event.corr, None)
        if flight is None:
            return
        chain = self.contexts.get(flight.context)
        if chain is not None and chain.in_flight == event.corr:
            chain.in_flight = None
            if event.ok:
                chain.written = len(chain.tokens)
                self._commit_full_pages(chain)
            else:
                self._roll_back(chain, flight)
        self.pool.release(flight.parked)
        self.pool.unpin(flight.pinned)

    def _commit_full_pages(self, chain: Chain) -> None:
        size = self.page_size
        while len(chain.hashes) < chain.written // size:
            j = len(chain.hashes)
            previous = chain.hashes[-1] if chain.hashes else b""
            content = chain_hash(
                previous,
                chain.tokens[j * size : (j + 1) * size],
                chain.positions[j * size : (j + 1) * size],
                chain.salt,
            )
            page = self.pool.commit(chain.pages[j], content)
            if page != chain.pages[j]:
                self.pool.share([page])
                self.pool.release([chain.pages[j]])
                chain.pages[j] = page
                self._shared_hits += 1
            chain.hashes.append(content)

    def _roll_back(self, chain: Chain, flight: InFlight) -> None:
        chain.lease = None
        del chain.tokens[flight.old_length :]
        del chain.positions[flight.old_length :]
        del chain.hashes[flight.old_length // self.page_size :]
        chain.written = min(chain.written, flight.old_length)
        chain.salt = flight.old_salt
        taken = list(flight.added_pages)
        for page in [*flight.added_pages, *flight.reused]:
            chain.pages.remove(page)
        self._release_chain(flight.reused)
        if flight.replaced_tail is not None:
            index, original = flight.replaced_tail
            taken.append(chain.pages[index])
            self.pool.share([original])
            chain.pages[index] = original
        # Each page goes back where `_take` found it, so the chain is as it was before the pass.
        chain.reserved[:0] = taken[: flight.from_reserve]
        chain.reserved.extend(flight.parked)
        flight.parked = []
        self.pool.release(taken[flight.from_reserve :])

    # -- context lifecycle -------------------------------------------------------------------

    def _created(self, event: Any, chain: Chain) -> list[Output]:
        context = self._next_context
        self._next_context += 1
        self.contexts[context] = chain
        return [(event.requester, ev.ContextCreated(corr=event.corr, context=context))]

    def _open(self, event: ev.OpenContext) -> list[Output]:
        key = (event.user, event.name)
        snapshot = self._snapshot(key)
        if event.take:
            del self.snapshots[key]
            snapshot.owner = event.requester
            return self._created(event, snapshot)
        self.pool.share(snapshot.held())
        return self._created(event, snapshot.copy(event.requester))

    def _save(self, event: ev.SaveContext) -> list[Output]:
        chain = self._owned(event.context, event.requester)
        self._quiet(chain, "save")
        chain.lease = None
        key = (event.user, event.name)
        if key in self.snapshots:
            raise RequestError("snapshot_exists", f"a snapshot named {event.name!r} exists")
        snapshot = chain.copy(owner=f"snapshot:{event.user}")
        snapshot.user = event.user
        check_snapshot(self.quotas, self.snapshots.values(), snapshot)
        self.pool.share(chain.held())
        self.snapshots[key] = snapshot
        return [(event.requester, ev.Done(corr=event.corr))]

    def _delete_snapshot(self, key: tuple[str, str]) -> None:
        self._release_chain(self.snapshots.pop(key).held())

    def _drop(self, context: int) -> None:
        chain = self.contexts.pop(context)
        self._release_chain(chain.held())
        self.pool.release(chain.reserved)

    def _release_chain(self, pages: list[int]) -> None:
        """Releases a run of a chain's pages from its end, so that the pages that become cached
        are evicted deepest first: a cached page is only found through the pages before it."""
        self.pool.release(reversed(pages))

    def _reserve(self, chain: Chain, count: int) -> None:
        # A pass in flight is no obstacle: it already holds its pages, and the pages it took
        # from the reserve go back to the reserve's front if it fails. A copied tail needs one
        # fresh page more.
        if count < 0:
            raise RequestError("invalid", f"cannot reserve {count} tokens")
        length = len(chain.tokens)
        copy = 1 if count and self._tail_needing_copy(chain, length) is not None else 0
        wanted = self._pages_for(length + count) + copy - len(chain.pages) - len(chain.reserved)
        self.pool.check_room(wanted)
        check_growth(self.quotas, self.contexts.values(), chain, wanted, in_use=self.pool.in_use)
        chain.reserved.extend(self.pool.allocate(max(wanted, 0)))

    def _truncate(self, chain: Chain, count: int) -> None:
        self._quiet(chain, "truncate")
        chain.lease = None
        if not 0 <= count <= len(chain.tokens):
            raise RequestError("invalid", f"cannot truncate {count} of {len(chain.tokens)} tokens")
        length = len(chain.tokens) - count
        keep = self._pages_for(length)
        if length % self.page_size and chain.pages[keep - 1] == RELEASED:
            raise RequestError(
                "invalid", f"cannot truncate into page {keep - 1}: its KV was released"
            )
        self._release_chain([page for page in chain.pages[keep:] if page != RELEASED])
        del chain.pages[keep:]
        del chain.tokens[length:]
        del chain.positions[length:]
        del chain.hashes[length // self.page_size :]
        chain.written = min(chain.written, length)
        chain.masked = {p for p in chain.masked if p < keep}

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

    def _describe(self, event: ev.DescribeContext) -> ev.ContextInfo:
        chain = self._owned(event.context, event.requester)
        return ev.ContextInfo(
            corr=event.corr,
            context=event.context,
            tokens=tuple(chain.tokens),
            positions=tuple(chain.positions),
            pages=len(chain.held()),
            masked_pages=tuple(sorted(chain.masked)),
            released_pages=tuple(chain.released()),
            reserved_pages=len(chain.reserved),
        )

    # -- lookups ---------------------------------------------------------------------------

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
            raise RequestError("no_such_snapshot", f"no snapshot named {key[1]!r}")
        return snapshot

    @staticmethod
    def _quiet(chain: Chain, verb: str) -> None:
        if chain.in_flight is not None:
            raise RequestError("busy", f"cannot {verb} a context while its pass is in flight")

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
