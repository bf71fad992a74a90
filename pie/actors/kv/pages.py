"""The page pool: who owns each KV page, who pins it for a pass in flight, and the index of
committed pages by content hash."""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Iterable, Sequence


class OutOfPages(Exception):
    """Not enough free pages for a request."""


def chain_hash(
    previous: bytes, tokens: Sequence[int], positions: Sequence[int], salt: bytes
) -> bytes:
    """The identity of a full page: its tokens and positions, chained over everything before it.

    `salt` covers what else shaped the KV (custom attention masks, masked pages).
    """
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(salt)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    digest.update(struct.pack(f"<{len(positions)}q", *positions))
    return digest.digest()


class PagePool:
    """Page ids 0..num_pages-1. A page is free when nothing owns or pins it.

    Owners are contexts and snapshots (a page with more than one owner is shared and must be
    copied before a write); pins are passes in flight that read or write the page. Allocation
    takes the lowest free ids, so the next allocation depends only on which pages are free, not
    on the order they were freed in: undoing a change (a rolled-back pass) restores it exactly.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the page pool needs at least one page")
        self.num_pages = num_pages
        self._owners = [0] * num_pages
        self._pins = [0] * num_pages
        self._free = list(range(num_pages))
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(
                f"need {count} free KV pages, {len(self._free)} of {self.num_pages} free"
            )
        pages = [heapq.heappop(self._free) for _ in range(count)]
        for page in pages:
            self._owners[page] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        for page in pages:
            assert self._owners[page] + self._pins[page] > 0, f"sharing free page {page}"
            self._owners[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        for page in pages:
            assert self._owners[page] > 0, f"releasing free page {page}"
            self._owners[page] -= 1
            self._maybe_free(page)

    def pin(self, pages: Iterable[int]) -> None:
        for page in pages:
            self._pins[page] += 1

    def unpin(self, pages: Iterable[int]) -> None:
        for page in pages:
            assert self._pins[page] > 0, f"unpinning unpinned page {page}"
            self._pins[page] -= 1
            self._maybe_free(page)

    def writable(self, page: int) -> bool:
        """Only a page with one owner that is not committed under a hash may change."""
        return self._owners[page] == 1 and page not in self._hash_of

    def commit(self, page: int, content: bytes) -> int:
        """Registers a full page under its hash; returns the page to use (an existing twin
        when one is committed already, in which case the caller swaps its reference)."""
        twin = self._by_hash.get(content)
        if twin is not None and twin != page:
            return twin
        self._by_hash[content] = page
        self._hash_of[page] = content
        return page

    def owners(self, page: int) -> int:
        return self._owners[page]

    def state(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, bytes], ...]]:
        """Owners, pins and the committed pages, for comparing two pools exactly."""
        return tuple(self._owners), tuple(self._pins), tuple(sorted(self._hash_of.items()))

    def _maybe_free(self, page: int) -> None:
        if self._owners[page] == 0 and self._pins[page] == 0:
            content = self._hash_of.pop(page, None)
            if content is not None:
                del self._by_hash[content]
            heapq.heappush(self._free, page)
