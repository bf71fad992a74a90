"""Placing passes in pages and settling them: the pages a pass takes (the reserve first, a
copied tail, committed pages reused by prefix caching), the lease it may earn, the commit of
full pages once it is written, and the exact roll-back of one that failed."""

from __future__ import annotations

from pie.actors.kv.context import Chain, InFlight
from pie.actors.kv.leases import lease_for
from pie.actors.kv.pages import chain_hash, salted
from pie.actors.kv.prefix import park_surplus, skip_tokens
from pie.actors.kv.quotas import check_growth, check_size
from pie.actors.kv.state import KvState
from pie.actors.kv.validation import check_adapter, validate_forward
from pie.actors.kv.window import Compactor, check_window, leaving
from pie.events import kv as ev
from pie.events.forward import ForwardRequest, PageCopy
from pie.events.speculation import LanePassApplied, Lease


class PassPlacement(KvState):
    def _place(self, event: ev.SubmitForward) -> ForwardRequest:
        chain = self._owned(event.context, event.requester)
        self._quiet(chain, "submit a pass to")
        validate_forward(event, len(chain.tokens), self.vocab_size, self.outputs)
        check_adapter(event.adapter, self.adapters)
        window = event.window if event.window is not None else self.model_window
        if window is not None:
            check_window(window)
            self._release(chain, leaving(chain, window, self.page_size))
        positions = event.positions
        if positions is None:
            start = chain.next_position()
            positions = tuple(range(start, start + len(event.tokens)))
        old_length = len(chain.tokens)
        old_salt, old_adapter = chain.salt, chain.adapter
        salt = _pass_salt(chain, event)
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
        chain.adapter = event.adapter
        chain.run_adapter(old_length, event.adapter)
        if event.attention_masks is not None:
            chain.run_masks(old_length, event.attention_masks)
        chain.run_media(old_length, event.media)
        chain.tokens.extend(event.tokens)
        chain.positions.extend(positions)
        chain.in_flight = event.corr
        pinned = chain.held()
        self.pool.pin(pinned)
        if replaced:
            pinned.append(replaced[1])
        lease = self._grant(event, chain, windowed=window is not None) if event.fast else None
        self.in_flight[event.corr] = InFlight(
            context=event.context,
            old_length=old_length,
            pinned=pinned,
            added_pages=added,
            replaced_tail=replaced,
            old_salt=old_salt,
            old_adapter=old_adapter,
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
            adapter=event.adapter,
            lease=lease,
            media=event.media,
        )
        request = skip_tokens(request, len(reused) * self.page_size)
        return Compactor(released, self.page_size).request(request)

    def _grant(self, event: ev.SubmitForward, chain: Chain, *, windowed: bool) -> Lease | None:
        chain.lease = None
        lease = lease_for(event, chain, self._next_lease, self.page_size, reserve=not windowed)
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
        chain.adapter = flight.old_adapter
        chain.cut_runs(flight.old_length)
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


def _pass_salt(chain: Chain, event: ev.SubmitForward) -> bytes:
    """The salt the pass's pages are hashed under: the chain's, changed where the pass runs
    through another adapter than the chain's last pass (so KV computed under one adapter is
    never taken for another's or the base model's), by custom attention masks, and by media
    (whose placeholder tokens are the same for every picture)."""
    salt = chain.salt
    if event.adapter != chain.adapter:
        salt = salted(salt, f"adapter {event.adapter}")
    if event.attention_masks is not None:
        salt = salted(salt, repr(event.attention_masks))
    for run in event.media:
        salt = salted(salt, f"media {run.index} {run.count} {run.media} {run.offset}")
    return salt
