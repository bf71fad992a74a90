"""Page quotas: how many KV pages one requester (an inferlet), one user's contexts and one user's
snapshots may hold, so that no one of them can take the pool from the others."""

from __future__ import annotations

from collections.abc import Iterable

from attrs import frozen

from pie.actors.kv.context import Chain
from pie.actors.kv.pages import OutOfPages
from pie.actors.kv.validation import RequestError


@frozen(kw_only=True)
class Quotas:
    """Pages, not shares: a page held by several chains of one holder counts once."""

    inferlet: int
    user: int
    snapshots: int

    @classmethod
    def unlimited(cls, num_pages: int) -> Quotas:
        return cls(inferlet=num_pages, user=num_pages, snapshots=num_pages)

    @classmethod
    def shares(cls, num_pages: int, *, inferlet: float, user: float, snapshots: float) -> Quotas:
        """Quotas as fractions of a pool of `num_pages`; each is at least one page."""
        return cls(
            inferlet=_pages(num_pages, inferlet),
            user=_pages(num_pages, user),
            snapshots=_pages(num_pages, snapshots),
        )

    @property
    def context(self) -> int:
        """The most pages one context may ever hold: more can never be admitted."""
        return min(self.inferlet, self.user)


def _pages(num_pages: int, share: float) -> int:
    if not 0.0 < share <= 1.0:
        raise ValueError(f"a page share must be in (0, 1], got {share}")
    return max(1, int(num_pages * share))


def held(chains: Iterable[Chain]) -> set[int]:
    """The distinct pages the chains hold, their reserves included (forks share, so count once)."""
    pages: set[int] = set()
    for chain in chains:
        pages.update(chain.held())
        pages.update(chain.reserved)
    return pages


def check_size(quotas: Quotas, tokens: int, pages: int) -> None:
    """Refuses, as too large, a context that would need more pages than it may ever hold."""
    if pages > quotas.context:
        raise RequestError(
            "too_large",
            f"a context of {tokens} tokens needs {pages} KV pages; one context may hold at most "
            f"{quotas.context}",
        )


def check_growth(
    quotas: Quotas,
    contexts: Iterable[Chain],
    chain: Chain,
    grow: int,
    attached: Iterable[int] = (),
    *,
    in_use: int | None = None,
) -> None:
    """Raises OutOfPages when `grow` fresh pages and the committed pages `attached` (prefix
    caching) would put `chain`'s requester or its user over their quota. `in_use`, the pages
    held in the whole pool, bounds what any holder holds: while even all of them and the new
    ones fit under both quotas, nobody's holdings are counted (a pass takes new pages often)."""
    attached = set(attached)
    if grow <= 0 and not attached:
        return
    if in_use is not None and in_use + len(attached) + grow <= quotas.context:
        return
    chains = list(contexts)
    mine = len(held(c for c in chains if c.owner == chain.owner) | attached)
    if mine + grow > quotas.inferlet:
        raise OutOfPages(
            f"{chain.owner} holds {mine} KV pages and asks for {grow} more; "
            f"its quota is {quotas.inferlet}"
        )
    users = len(held(c for c in chains if c.user == chain.user) | attached)
    if users + grow > quotas.user:
        raise OutOfPages(
            f"user {chain.user!r} holds {users} KV pages and asks for {grow} more; "
            f"the user quota is {quotas.user}"
        )


def check_snapshot(quotas: Quotas, snapshots: Iterable[Chain], chain: Chain) -> None:
    """Refuses a snapshot that would put its user's snapshots over their page quota."""
    total = len(held([*(s for s in snapshots if s.user == chain.user), chain]))
    if total > quotas.snapshots:
        raise RequestError(
            "snapshot_quota",
            f"user {chain.user!r}'s snapshots would hold {total} KV pages; "
            f"their quota is {quotas.snapshots}",
        )
