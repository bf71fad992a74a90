"""The kv core's view of one context (or snapshot): its page chain and the tokens in it."""

from __future__ import annotations

import attrs
from attrs import define, field

from pie.events.forward import MediaRun, split_media
from pie.events.sampling import Rle

RELEASED = -1
"""Stands in a chain's `pages` for a page whose KV was released: page indices keep counting
tokens (token i is in page i // page_size) while the pool has the page back."""


@define
class Chain:
    """Tokens, positions and the pages holding their KV.

    Token i lives in pages[i // page_size]. `hashes[j]` identifies full page j once its KV is
    written (committed); `written` counts tokens whose KV exists. `reserved` pages are owned by
    the chain but hold no tokens yet: later passes take them, in order, before the pool's.
    Released pages stay in `pages` as RELEASED (and in `masked`): only full, committed pages
    are released, so the tail a pass writes into is always held.
    """

    owner: str
    user: str = "local"
    """Whose quota the chain's pages count against."""
    pages: list[int] = field(factory=list)
    tokens: list[int] = field(factory=list)
    positions: list[int] = field(factory=list)
    hashes: list[bytes] = field(factory=list)
    written: int = 0
    masked: set[int] = field(factory=set)
    salt: bytes = b""
    in_flight: int | None = None
    """The corr of the pass writing into this chain, if any."""
    reserved: list[int] = field(factory=list)
    lease: int | None = None
    """The lease the fast path runs this context's plain decodes on, if any."""
    adapter: str | None = None
    """The LoRA adapter the last pass ran through: the salt changes when the next one differs."""
    adapter_runs: list[tuple[int, str | None]] = field(factory=list)
    """(first token, adapter) where the adapter the tokens ran through changes; tokens before
    the first run ran through the base model. A durable snapshot rebuilds each run through its
    own adapter."""
    mask_runs: list[tuple[int, tuple[Rle, ...]]] = field(factory=list)
    """(first token, one mask per token) for the tokens whose KV was computed under custom
    attention masks; the other tokens ran causally. Contiguous runs are one: each mask covers
    the kv slots up to its own token, so masks do not depend on how tokens were grouped into
    passes. A durable snapshot rebuilds each run under its masks."""
    media_runs: list[MediaRun] = field(factory=list)
    """The chain's soft tokens (indices count from its first token): which media's encoder
    output each one's KV was computed from."""
    resume: tuple[int, int] | None = None
    """(length, position) after a truncation: while the chain holds `length` tokens, the next
    token takes the first cut token's position. Positions need not follow each other (text
    after a medium's span continues past its largest index), so a token cut and written again
    keeps its place."""

    def copy(self, owner: str) -> Chain:
        """The same tokens over the same pages (the caller counts the new owner in the pool),
        with an empty reserve: reserved pages are this chain's alone."""
        return Chain(
            owner=owner,
            user=self.user,
            pages=list(self.pages),
            tokens=list(self.tokens),
            positions=list(self.positions),
            hashes=list(self.hashes),
            written=self.written,
            masked=set(self.masked),
            salt=self.salt,
            adapter=self.adapter,
            adapter_runs=list(self.adapter_runs),
            mask_runs=list(self.mask_runs),
            media_runs=list(self.media_runs),
            resume=self.resume,
        )

    def held(self) -> list[int]:
        """The pool pages the chain holds tokens in (released ones left out)."""
        return [page for page in self.pages if page != RELEASED]

    def released(self) -> list[int]:
        """The indices of the released pages, in order."""
        return [j for j, page in enumerate(self.pages) if page == RELEASED]

    def next_position(self) -> int:
        if self.resume is not None and self.resume[0] == len(self.positions):
            return self.resume[1]
        return self.positions[-1] + 1 if self.positions else 0

    def state(self) -> tuple[object, ...]:
        return (
            self.owner,
            self.user,
            tuple(self.pages),
            tuple(self.tokens),
            tuple(self.positions),
            tuple(self.hashes),
            self.written,
            tuple(sorted(self.masked)),
            self.salt,
            tuple(self.reserved),
            self.lease,
            self.adapter,
            tuple(self.adapter_runs),
            tuple(self.mask_runs),
            tuple(self.media_runs),
            self.resume,
        )

    def run_adapter(self, start: int, adapter: str | None) -> None:
        """Notes that the tokens from `start` run through `adapter`."""
        current = self.adapter_runs[-1][1] if self.adapter_runs else None
        if adapter != current:
            self.adapter_runs.append((start, adapter))

    def run_masks(self, start: int, masks: tuple[Rle, ...]) -> None:
        """Notes that the tokens from `start` ran under `masks`, each cut to the slots its token
        can see (a mask may cover the whole pass; causality hides the slots after its token)."""
        seen = tuple(_clip(mask, start + i + 1) for i, mask in enumerate(masks))
        if self.mask_runs and _end(self.mask_runs[-1]) == start:
            first, earlier = self.mask_runs.pop()
            self.mask_runs.append((first, earlier + seen))
        else:
            self.mask_runs.append((start, seen))

    def cut_runs(self, length: int) -> None:
        """Forgets the adapter, mask and media runs of the tokens at or after `length` (they are
        gone), keeping the front of a mask or media run that straddles it."""
        self.adapter_runs = [run for run in self.adapter_runs if run[0] < length]
        self.mask_runs = [
            (start, masks[: length - start]) for start, masks in self.mask_runs if start < length
        ]
        self.media_runs = list(split_media(tuple(self.media_runs), 0, length))

    def run_media(self, start: int, runs: tuple[MediaRun, ...]) -> None:
        """Notes the soft tokens of a pass whose first token is the chain's token `start`."""
        self.media_runs.extend(attrs.evolve(run, index=start + run.index) for run in runs)


@define
class InFlight:
    """What a placed pass changed, so that it can be committed or rolled back."""

    context: int
    old_length: int
    pinned: list[int]
    added_pages: list[int]
    replaced_tail: tuple[int, int] | None
    """(index, original page) when the tail page was copied before writing."""
    old_salt: bytes
    old_adapter: str | None = None
    from_reserve: int = 0
    """How many of the pages the pass took (added pages, then the tail's copy) came from the
    chain's reserve: a rollback returns those to the reserve rather than the pool."""
    reused: list[int] = field(factory=list)
    """Committed pages the pass attached instead of computing them (prefix caching)."""
    parked: list[int] = field(factory=list)
    """Reserved pages the reused ones made needless: the pass owns them until it settles."""


def _end(run: tuple[int, tuple[Rle, ...]]) -> int:
    return run[0] + len(run[1])


def _clip(mask: Rle, width: int) -> Rle:
    """`mask` over kv slots [0, width) only (it covers at least as many)."""
    if sum(mask) == width:
        return mask
    runs: list[int] = []
    left = width
    for run in mask:
        if left == 0:
            break
        runs.append(min(run, left))
        left -= runs[-1]
    return tuple(runs)
