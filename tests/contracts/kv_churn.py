"""Random command sequences for the kv core: a hypothesis state machine that keeps a model of
every context's and snapshot's tokens, checks each reply against it, and checks every invariant
after each step."""

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
    """Two requesters with up to six contexts on a pool of 48 tokens' worth of pages, three
    tokens in the vocabulary, passes settled at once or left in flight across other commands."""

    def __init__(self, make_core: MakeCore, page_size: int, seen: Counter[str]) -> None:
        super().__init__()
        self.kv = KvSession(make_core(num_pages=48 // page_size, page_size=page_size, vocab_size=3))
        self.seen = seen
        self.tokens: dict[int, list[int]] = {}
        self.owner: dict[int, str] = {}
        self.saved: dict[str, list[int]] = {}
        self.flights: list[tuple[ForwardRequest, int]] = []
        """Passes in flight and their context's length before each."""
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

    def _adopt(self, reply: Any, tokens: list[int], requester: str) -> None:
        context = reply.context
        self.tokens[context], self.owner[context] = list(tokens), requester
        assert self.kv.tokens(context, requester) == tuple(tokens)

    @precondition(lambda self: len(self.tokens) < 6)
    @rule(requester=REQUESTERS)
    def create(self, requester: str) -> None:
        self._adopt(self.kv.ok(ev.CreateContext, requester), [], requester)

    @precondition(lambda self: self.tokens)
    @rule(pick=PICK)
    def fork(self, pick: int) -> None:
        source = self._pick(pick)
        reply = self.kv.ask(ev.ForkContext, self.owner[source], context=source)
        if self._expect(reply, "busy" if self._busy(source) else None):
            self._adopt(reply, self.tokens[source], self.owner[source])

    @precondition(lambda self: self.tokens)
    @rule(pick=PICK, name=NAMES)
    def save(self, pick: int, name: str) -> None:
        context = self._pick(pick)
        refusal = "busy" if self._busy(context) else None
        refusal = refusal or ("snapshot_exists" if name in self.saved else None)
        reply = self.kv.ask(ev.SaveContext, self.owner[context], context=context, name=name)
        if self._expect(reply, refusal):
            self.saved[name] = list(self.tokens[context])

    @precondition(lambda self: self.saved)
    @rule(name=NAMES, take=st.booleans(), requester=REQUESTERS)
    def open(self, name: str, take: bool, requester: str) -> None:
        reply = self.kv.ask(ev.OpenContext, requester, name=name, take=take)
        if self._expect(reply, None if name in self.saved else "no_such_snapshot"):
            tokens = self.saved.pop(name) if take else self.saved[name]
            self._adopt(reply, tokens, requester)

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
        assert (reply.kv_start, reply.positions) == (old, tuple(range(old, old + len(tokens))))
        assert_writes_are_private(self.kv.core, reply)
        self.seen["tail copies"] += len(reply.copies)
        self.tokens[context].extend(tokens)
        self.flights.append((reply, old))
        if reply.lease is not None:
            self.leases.append((reply.lease.lease, context))
            self.seen["leases"] += 1
        if settle != "later":
            self._settle(len(self.flights) - 1, settle == "ok")

    @precondition(lambda self: self.flights)
    @rule(pick=PICK, ok=st.booleans())
    def apply(self, pick: int, ok: bool) -> None:
        self._settle(pick % len(self.flights), ok)

    def _settle(self, index: int, ok: bool) -> None:
        request, old = self.flights.pop(index)
        self.kv.apply(request, ok)
        if not ok and request.context in self.tokens:
            del self.tokens[request.context][old:]

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

    def teardown(self) -> None:
        """Ending every pass and lease and dropping every context and snapshot frees it all."""
        self.seen["shared page hits"] += self.kv.core.statistics().shared_page_hits
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
        assert self.kv.core.pool.state()[2] == ()
