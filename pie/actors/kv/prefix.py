"""Prefix caching for the kv core: which committed pages a pass attaches instead of computing
them, whose pages a context may reuse (the scope), and how the request then starts later."""

from __future__ import annotations

import hashlib

from attrs import evolve

from pie.actors.kv.context import Chain
from pie.actors.kv.pages import PagePool, chain_hash
from pie.events.forward import ForwardRequest, split_media
from pie.events.kv import SubmitForward

SCOPES = ("off", "user", "global")
"""Whose pages a context may reuse: nobody's, its own user's, or everyone's."""

Reuse = list[tuple[int, bytes]]
"""Committed pages a pass attaches instead of computing them, with their content hashes."""


def first_salt(scope: str, user: str) -> bytes:
    """The salt a new context's page hashes start from: under the "user" scope its user, so
    that contexts of two users never hold a page under the same hash."""
    if scope != "user":
        return b""
    return hashlib.blake2b(f"user {user}".encode(), digest_size=16).digest()


class PrefixCache:
    """The lookups of one kv core under one scope, and what they found."""

    def __init__(self, scope: str, pool: PagePool, page_size: int) -> None:
        if scope not in SCOPES:
            raise ValueError(f"prefix_cache must be one of {', '.join(SCOPES)}, got {scope!r}")
        self.scope = scope
        self.pool = pool
        self.page_size = page_size
        self.lookups = 0
        """Passes that looked for their leading full pages."""
        self.hits = 0
        """Lookups that found at least one page."""
        self.hit_pages = 0

    def first_salt(self, user: str) -> bytes:
        return first_salt(self.scope, user)

    def find(
        self, chain: Chain, event: SubmitForward, positions: tuple[int, ...], salt: bytes
    ) -> Reuse | None:
        """The committed pages that hold the pass's leading full pages already, or None when
        the pass may not look: the cache is off, or the context does not end on a page boundary
        with all its pages committed, or no full page lies before the first token the pass
        must compute (the first one a slot reads, and at least the last one)."""
        size = self.page_size
        if self.scope == "off" or len(chain.hashes) * size != len(chain.tokens):
            return None
        pages = min([len(event.tokens) - 1, *(s.index for s in event.slots)]) // size
        if pages == 0:
            return None
        found: Reuse = []
        previous = chain.hashes[-1] if chain.hashes else b""
        for start in range(0, pages * size, size):
            window = slice(start, start + size)
            content = chain_hash(previous, event.tokens[window], positions[window], salt)
            page = self.pool.lookup(content)
            if page is None:
                break
            found.append((page, content))
            previous = content
        return found

    def attach(self, chain: Chain, reuse: Reuse | None) -> None:
        """Appends the reused pages to the chain as committed pages it owns, as a fork would,
        and counts the lookup."""
        if reuse is None:
            return
        self.lookups += 1
        if not reuse:
            return
        self.hits += 1
        self.hit_pages += len(reuse)
        self.pool.share(page for page, _ in reuse)
        chain.pages.extend(page for page, _ in reuse)
        chain.hashes.extend(content for _, content in reuse)
        chain.written = len(chain.hashes) * self.page_size


def park_surplus(chain: Chain, reused: int) -> list[int]:
    """Takes out of the reserve, from its end, the pages that reused pages made needless (a
    reservation counted on computing those tokens). The pass holds them until it settles: they
    are released when it succeeds and go back to the reserve's end when it fails."""
    keep = len(chain.reserved) - min(reused, len(chain.reserved))
    parked = chain.reserved[keep:]
    del chain.reserved[keep:]
    return parked


def skip_tokens(request: ForwardRequest, count: int) -> ForwardRequest:
    """The request without its first `count` tokens, whose KV is in place already; its slots
    read the same tokens as before."""
    if count == 0:
        return request
    masks = request.attention_masks
    return evolve(
        request,
        tokens=request.tokens[count:],
        positions=request.positions[count:],
        kv_start=request.kv_start + count,
        attention_masks=None if masks is None else masks[count:],
        slots=tuple(evolve(s, index=s.index - count) for s in request.slots),
        media=split_media(request.media, count, len(request.tokens)),
    )
