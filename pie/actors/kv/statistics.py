"""What the kv actor reports of itself: pages, contexts, sharing, leases and the prefix cache."""

from __future__ import annotations

from attrs import frozen


@frozen(kw_only=True)
class KvStatistics:
    page_size: int
    pages_total: int
    pages_free: int
    contexts: int
    snapshots: int
    passes_in_flight: int
    shared_page_hits: int
    tail_copies: int
    leases: int
    prefix_cache: str = "user"
    pages_cached: int = 0
    """Free pages that still hold committed content a pass may reuse (part of pages_free)."""
    prefix_lookups: int = 0
    """Passes that looked for their leading full pages among the committed ones."""
    prefix_hits: int = 0
    """Lookups that reused at least one page."""
    prefix_hit_pages: int = 0
    prefix_hit_tokens: int = 0
    """Tokens that never went to the driver because their pages were reused."""
    pages_evicted: int = 0
    pages_released: int = 0
    """Pages contexts gave back while keeping their tokens (attention windows and sinks)."""
