"""Random command sequences for the kv core: a hypothesis state machine that keeps a model of
every context's and snapshot's tokens and of what each page's KV slots hold (what the driver
wrote there), checks each reply against it, and checks every invariant after each step."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pie.events import kv as ev
from pie.events.forward import ForwardRequest
from pie.events.speculation import LeaseReleased
from tests.contracts.kv_invariants import (
    KvSession,
    MakeCore,
    assert_invariants,
    assert_writes_are_private,
    decode_slot,
    free_pages,
)

NAMES = st.sampled_from(["s0", "s1", "s2"])
PICK = st.sampled_from(range(720))
"""Picks one of a few things by remainder: 720 divides evenly among up to 6 (and sampled_from
spreads its draws, where integers favour small values)."""
REQUESTERS = st.sampled_from(["a", "b"])
TOKENS = st.one_of(
    st.sampled_from([[0, 1, 2, 0, 1, 2, 0, 1, 2], [2, 2, 1, 0, 0]]),
    st.lists(st.integers(0, 2), min_size=1, max_size=9),
)
"""Common prompts, so that contexts often fill equal pages, or any tokens."""


class KvChurn(RuleBasedStateMachine):
    """Two requesters (each its own user) with up to six contexts on a pool of 48 tokens' worth
    of pages, three tokens in the vocabulary, passes settled at once or left in flight across
    other commands, under one prefix cache scope."""

    def __init__(
        self, make_core: MakeCore, page_size: int, seen: Counter[str], prefix_cache: str = "user"
    ) -> None:
        super().__init__()
        core = make_core(
            num_pages=48 // page_size,
            page_size=page_size,
            vocab_size=3,
            prefix_cache=prefix_cache,
        )
        self.kv = KvSession(core)
        self.seen = seen
        self.tokens: dict[int, list[int]] = {}
        self.owner: dict[int, str] = {}
        self.user: dict[int, str] = {}
        """Whose pages a context may reuse: its creator's (forks and snapshots inherit it)."""
        self.saved: dict[str, list[int]] = {}
        self.saved_user: dict[str, str] = {}
        self.flights: list[tuple[ForwardRequest, int]] = []
        """Passes in flight and their context's length before each."""
        self.writer: dict[int, str] = {}
        """The user of each pass in flight, by corr."""
        self.slots: dict[tuple[int, int], tuple[int, int, str]] = {}
        """What the driver wrote in each (page, offset): token, position and the writer's user."""
        self.leases: list[tuple[int, int]] = []

    def _pick(self, pick: int) -> int:
        return sorted(self.tokens)[pick % len(self.tokens)]

    def _busy(self, context: int) -> bool:
        return any(request.context == context for request, _ in self.flights)

    def _expect(self, reply: Any, refusal: str | None) -> bool:
        """True when the command succeeded, after checking it failed exactly when expected."""
        failed = reply.kind if isinstance(reply, ev.RequestFailed) else None
        assert failed == refusal, (failed, refusal)
        return failed is None

    def _adopt(self, reply: Any, tokens: list[int], requester: str, user: str) -> None:
        context = reply.context
        self.tokens[context], self.owner[context] = list(tokens), requester
        self.user[context] = user
        assert self.kv.tokens(context, requester) == tuple(tokens)

    @precondition(lambda self: len(self.tokens) < 6)
    @rule(requester=REQUESTERS)
    def create(self, requester: str) -> None:
        reply = self.kv.ok(ev.CreateContext, requester, user=requester)
        self._adopt(reply, [], requester, requester)

    @precondition(lambda self: self.tokens)
    @rule(pick=PICK)
    def fork(self, pick: int) -> None:
        source = self._pick(pick)
        reply = self.kv.ask(ev.ForkContext, self.owner[source], context=source)
        if self._expect(reply, "busy" if self._busy(source) else None):
            self._adopt(reply, self.tokens[source], self.owner[source], self.user[source])

    @precondition(lambda self: self.tokens)
    @rule(pick=PICK, name=NAMES)
    def save(self, pick: int, name: str) -> None:
        context = self._pick(pick)
        refusal = "busy" if self._busy(context) else None
        refusal = refusal or ("snapshot_exists" if name in self.saved else None)
        reply = self.kv.ask(ev.SaveContext, self.owner[context], context=context, name=name)
        if self._expect(reply, refusal):
            self.saved[name] = list(self.tokens[context])
            self.saved_user[name] = self.user[context]

    @precondition(lambda self: self.saved)
    @rule(name=NAMES, take=st.booleans(), requester=REQUESTERS)
    def open(self, name: str, take: bool, requester: str) -> None:
        reply = self.kv.ask(ev.OpenContext, requester, name=name, take=take)
        if self._expect(reply, None if name in self.saved else "no_such_snapshot"):
            tokens = self.saved.pop(name) if take else self.saved[name]
            self._adopt(reply, tokens, requester, self.saved_user[name])

    @precondition(lambda self: self.saved)
    @rule(name=NAMES)
    def delete(self, name: str) -> None:
        reply = self.kv.ask(ev.DeleteSnapshot, name=name)
        if self._expect(reply, None if name in self.saved else "no_such_snapshot"):
            del self.saved[name]

    @precondition(lambda self: self.tokens)
    @rule(pick=PICK, share=PICK)
    def truncate(self, pick: int, share: int) -> None:
        """Any count up to the context's length, or one more (refused)."""
        context = self._pick(pick)
        length = len(self.tokens[context])
        count = share % (length + 2)
        refusal = "busy" if self._busy(context) else ("invalid" if count > length else None)
        reply = self.kv.ask(ev.TruncateContext, self.owner[context], context=context, count=count)
        if self._expect(reply, refusal):
            del self.tokens[context][length - count :]

    @precondition(lambda self: self.tokens)
    @rule(pick=PICK, index=PICK, masked=st.booleans())
    def mask(self, pick: int, index: int, masked: bool) -> None:
        """Any page of the context, or the one past its end (refused)."""
        context = self._pick(pick)
        pages = -(-len(self.tokens[context]) // self.kv.core.page_size)
        page = index % (pages + 1)
        refusal = "busy" if self._busy(context) else ("invalid" if page >= pages else None)
        owner = self.owner[context]
        reply = self.kv.ask(ev.MaskPages, owner, context=context, pages=(page,), masked=masked)
        self._expect(reply, refusal)

    @precondition(lambda self: self.tokens)
    @rule(pick=PICK, count=st.integers(0, 10))
    def reserve(self, pick: int, count: int) -> None:
        context = self._pick(pick)
        before = self.kv.core.state()
        reply = self.kv.ask(ev.ReserveTokens, self.owner[context], context=context, count=count)
        if isinstance(reply, ev.RequestFailed):
            assert reply.kind == "out_of_pages" and self.kv.core.state() == before

    @precondition(lambda self: self.tokens)
    @rule(
        pick=PICK,
        tokens=TOKENS,
        fast=st.booleans(),
        settle=st.sampled_from(["ok", "failed", "later"]),
    )
    def submit(self, pick: int, tokens: list[int], fast: bool, settle: str) -> None:
        """A pass placed, then applied, failed, or left in flight for later commands."""
        context = self._pick(pick)
        old = len(self.tokens[context])
        before = self.kv.core.state()
        slots = decode_slot(len(tokens)) if fast else ()
        reply = self.kv.ask(
            ev.SubmitForward,
            self.owner[context],
            context=context,
            tokens=tuple(tokens),
            slots=slots,
            fast=fast,
        )
        if isinstance(reply, ev.RequestFailed):
            assert reply.kind == ("busy" if self._busy(context) else "out_of_pages")
            assert self.kv.core.state() == before
            self.seen[reply.kind] += 1
            return
        self._check_placed(reply, context, old, tokens)
        self.seen["tail copies"] += len(reply.copies)
        self.tokens[context].extend(tokens)
        self.flights.append((reply, old))
        self.writer[reply.corr] = self.user[context]
        if reply.lease is not None:
            self.leases.append((reply.lease.lease, context))
            self.seen["leases"] += 1
        if settle != "later":
            self._settle(len(self.flights) - 1, settle == "ok")

    @precondition(lambda self: self.flights)
    @rule(pick=PICK, ok=st.booleans())
    def apply(self, pick: int, ok: bool) -> None:
        self._settle(pick % len(self.flights), ok)

    def _check_placed(
        self, reply: ForwardRequest, context: int, old: int, tokens: list[int]
    ) -> None:
        """The pass skips only whole pages of its tokens that are written already, with these
        very tokens at these positions, by the context's own user unless the scope is global;
        it always computes its last token."""
        size = self.kv.core.page_size
        skip = reply.kv_start - old
        assert 0 <= skip < len(tokens) and skip % size == 0
        assert reply.tokens == tuple(tokens[skip:])
        assert reply.positions == tuple(range(old + skip, old + len(tokens)))
        assert_writes_are_private(self.kv.core, reply)
        if not skip:
            return
        scope = self.kv.core.prefix_cache
        assert old % size == 0 and scope != "off"
        for i in range(skip):
            token, position, user = self.slots[(reply.pages[(old + i) // size], i % size)]
            assert (token, position) == (tokens[i], old + i)
            assert scope == "global" or user == self.user[context]
        self.seen["prefix hits"] += 1
        self.seen["reserves trimmed"] += bool(self.kv.core.in_flight[reply.corr].parked)

    def _settle(self, index: int, ok: bool) -> None:
        request, old = self.flights.pop(index)
        self.kv.apply(request, ok)
        writer = self.writer.pop(request.corr)
        if ok:
            self._write(request, writer)
        elif request.context in self.tokens:
            del self.tokens[request.context][old:]

    def _write(self, request: ForwardRequest, user: str) -> None:
        """What the driver does with a pass: copies, then the pass's tokens into their slots."""
        size = self.kv.core.page_size
        for copy in request.copies:
            for offset in range(size):
                if (copy.src, offset) in self.slots:
                    self.slots[(copy.dst, offset)] = self.slots[(copy.src, offset)]
        for i, slot in enumerate(range(request.kv_start, request.kv_len)):
            written = (request.tokens[i], request.positions[i], user)
            self.slots[(request.pages[slot // size], slot % size)] = written

    @precondition(lambda self: self.leases)
    @rule(pick=PICK)
    def release_lease(self, pick: int) -> None:
        lease, context = self.leases.pop(pick % len(self.leases))
        assert self.kv.core.handle(LeaseReleased(lease=lease, context=context)) == []

    @precondition(lambda self: len(self.tokens) >= 3)
    @rule(pick=PICK)
    def destroy(self, pick: int) -> None:
        context = self._pick(pick)
        self.kv.ok(ev.DestroyContext, self.owner[context], context=context)
        del self.tokens[context], self.owner[context]

    @precondition(lambda self: len(self.tokens) >= 5)
    @rule(requester=REQUESTERS)
    def release_requester(self, requester: str) -> None:
        self.kv.ok(ev.ReleaseRequester, requester)
        for context in [c for c, owner in self.owner.items() if owner == requester]:
            del self.tokens[context], self.owner[context]

    @precondition(lambda self: self.tokens)
    @rule(pick=PICK)
    def intrude(self, pick: int) -> None:
        context = self._pick(pick)
        stranger = "b" if self.owner[context] == "a" else "a"
        before = self.kv.core.state()
        assert self.kv.failed(ev.ForkContext, stranger, context=context) == "not_owner"
        assert self.kv.core.state() == before

    @invariant()
    def every_invariant_holds(self) -> None:
        assert_invariants(self.kv.core)
        for context, tokens in self.tokens.items():
            assert self.kv.tokens(context, self.owner[context]) == tuple(tokens)

    @invariant()
    def every_context_holds_the_kv_of_its_tokens(self) -> None:
        """Whatever pages a context came to hold (its own, a fork's, a snapshot's or reused
        ones), their slots hold its tokens at their positions, up to a pass still in flight
        (whose tail copies are still to be made: until then their pages read from the source)."""
        size = self.kv.core.page_size
        written = {request.context: old for request, old in self.flights}
        source = {c.dst: c.src for request, _ in self.flights for c in request.copies}
        for context, tokens in self.tokens.items():
            pages = [source.get(p, p) for p in self.kv.core.contexts[context].pages]
            for i in range(written.get(context, len(tokens))):
                assert self.slots[(pages[i // size], i % size)][:2] == (tokens[i], i)

    def teardown(self) -> None:
        """Ending every pass and lease and dropping every context and snapshot frees it all."""
        stats = self.kv.core.statistics()
        self.seen["shared page hits"] += stats.shared_page_hits
        self.seen["evictions"] += stats.pages_evicted
        for request, _ in self.flights:
            self.kv.apply(request)
        for lease, context in self.leases:
            self.kv.core.handle(LeaseReleased(lease=lease, context=context))
        for requester in ("a", "b"):
            self.kv.ok(ev.ReleaseRequester, requester)
        for name in self.saved:
            self.kv.ok(ev.DeleteSnapshot, name=name)
        assert_invariants(self.kv.core)
        assert free_pages(self.kv.core) == set(range(self.kv.core.pool.num_pages))
        committed = {page for page, _ in self.kv.core.pool.state()[2]}
        assert committed == set(self.kv.core.pool.cache_order())
