"""Outgoing HTTP: an inferlet's request to the http actor and its answer. A request that gets
no response (refused by the network policy, timed out, too large, unreachable) is answered
with a `RequestFailed` of that kind."""

from __future__ import annotations

from attrs import frozen


@frozen(kw_only=True)
class HttpFetch:
    corr: int
    requester: str
    user: str = ""
    """Whose inferlet asks: requests in flight are counted per inferlet and per user."""
    method: str
    url: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    timeout_seconds: float | None = None
    """None: the operator's `network.timeout_seconds` (also the most a request may ask)."""
    max_redirects: int | None = None
    """None: the operator's `network.max_redirects` (also the most a request may ask)."""


@frozen(kw_only=True)
class HttpFetched:
    corr: int
    status: int
    url: str
    """The URL the response came from, after redirects."""
    headers: tuple[tuple[str, str], ...]
    body: bytes
