"""The page pool: who owns each KV page, who pins it for a pass in flight, the index of
committed pages by content hash, and the committed pages kept after their last owner left."""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class OutOfPages(Exception):
    """Not enough free pages for a request."""


def salted(salt: bytes, text: str) -> bytes:
    """A page-hash salt extended by what else shapes the KV (attention masks, masked pages)."""
    return hashlib.blake2b(salt + text.encode(), digest_size=16).digest()


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
    copied before a write); pins are passes in flight that read or write the page. With
    `retain`, a committed page that becomes free is **cached**: it keeps its content hash, so a
    later pass can take it back (`share`) instead of computing it again. Allocation takes the
    lowest empty ids first, so while no cached page is needed the next allocation depends only
    on which pages are free, not on the order they were freed in; then it evicts cached pages,
    least recently released first, and forgets their hashes.
    """

    def __init__(self, num_pages: int, *, retain: bool = False) -> None:
        if num_pages < 1:
            raise ValueError("the page pool needs at least one page")
        self.num_pages = num_pages
        self.retain = retain
        self._owners = [0] * num_pages
        self._pins = [0] * num_pages
        self._free = list(range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()
        """Free committed pages, least recently released first."""
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.evictions = 0

    @property
    def free(self) -> int:
        """Pages an allocation may take: the empty ones and the cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        return len(self._cached)

    @property
    def in_use(self) -> int:
        """Pages that some context, snapshot or pass holds (neither empty nor cached)."""
        return self.num_pages - self.free

    @property
    def shared(self) -> int:
        """Pages with more than one owner (contexts and snapshots); two C-speed passes over
        the owner counts, for a pool of a hundred thousand pages."""
        owners = self._owners
        return len(owners) - owners.count(0) - owners.count(1)

    def check_room(self, count: int, keep: Iterable[int] = ()) -> None:
        """Raises OutOfPages unless `count` pages can be allocated without evicting `keep`."""
        room = self.free - sum(1 for page in set(keep) if page in self._cached)
        if count > room:
            raise OutOfPages(f"need {count} free KV pages, {room} of {self.num_pages} free")

    def allocate(self, count: int) -> list[int]:
        self.check_room(count)
        empty = min(count, len(self._free))
        pages = [heapq.heappop(self._free) for _ in range(empty)]
        pages += [self._evict() for _ in range(count - empty)]
        for page in pages:
            self._owners[page] = 1
        return pages

    def lookup(self, content: bytes) -> int | None:
        """The page committed under `content`, held or cached, if any."""
        return self._by_hash.get(content)

    def share(self, pages: Iterable[int]) -> None:
        """Counts one more owner of each page; a cached page is taken back out of the cache."""
        for page in pages:
            if page in self._cached:
                del self._cached[page]
            else:
                assert self._owners[page] + self._pins[page] > 0, f"sharing free page {page}"
            self._owners[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        for page in pages:
            assert self._owners[page] > 0, f"releasing free page {page}"
            self._owners[page] -= 1
            self._maybe_free(page)

    def pin(self, pages: Iterable[int]) -> None:
        for page in pages:
            assert page not in self._cached, f"pinning cached page {page}"
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

    def cache_order(self) -> tuple[int, ...]:
        """The cached pages, the next to be evicted first."""
        return tuple(self._cached)

    def _maybe_free(self, page: int) -> None:
        if self._owners[page] or self._pins[page]:
            return
        if self.retain and page in self._hash_of:
            self._cached[page] = None
            return
        self._forget(page)
        heapq.heappush(self._free, page)

    def _evict(self) -> int:
        page, _ = self._cached.popitem(last=False)
        self._forget(page)
        self.evictions += 1
        return page

    def _forget(self, page: int) -> None:
        content = self._hash_of.pop(page, None)
        if content is not None:
            del self._by_hash[content]
