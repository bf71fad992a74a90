"""How many outgoing requests each inferlet and each user may have in flight at once, so that
no one holds every pooled connection while the others' requests time out."""

from __future__ import annotations

from collections import Counter

from attrs import frozen


@frozen(kw_only=True)
class FetchQuota:
    per_inferlet: int
    per_user: int


class FetchAdmission:
    """Counts requests in flight by requester and by user; pure, no I/O."""

    def __init__(self, quota: FetchQuota) -> None:
        self.quota = quota
        self._by_requester: Counter[str] = Counter()
        self._by_user: Counter[str] = Counter()

    def admit(self, requester: str, user: str) -> str | None:
        """Counts a new request in and returns None, or returns why it is refused."""
        if self._by_requester[requester] >= self.quota.per_inferlet:
            return (
                f"this inferlet already has {self.quota.per_inferlet} requests in flight "
                "(network.max_fetches_per_inferlet)"
            )
        if self._by_user[user] >= self.quota.per_user:
            return (
                f"user {user!r} already has {self.quota.per_user} requests in flight "
                "(network.max_fetches_per_user)"
            )
        self._by_requester[requester] += 1
        self._by_user[user] += 1
        return None

    def release(self, requester: str, user: str) -> None:
        """A request counted in by `admit` has ended."""
        for counts, key in ((self._by_requester, requester), (self._by_user, user)):
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]

    def in_flight(self, requester: str) -> int:
        return self._by_requester[requester]
