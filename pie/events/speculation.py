"""Events of the fast path: leases the kv actor grants and passes run on them.

A lease lets the driver thread run one context's plain decodes (one token in, one token
sampler at it) without a round trip through the kv actor and the scheduler: it names the pages
those passes may read and write, all pinned until the lease is released. The kv actor learns
of each pass the context's program actually received through `LanePassApplied`, and
extends the context then, so the page table stays the kv actor's alone.
"""

from __future__ import annotations

from attrs import frozen

from pie.events.sampling import SlotOp, SlotOutput


class LaneBusy(Exception):
    """The context already has a pass on the fast path that its program has not received."""


@frozen(kw_only=True)
class Lease:
    lease: int
    context: int
    requester: str
    pages: tuple[int, ...]
    """The context's pages, then its reserved pages in the order it takes them."""
    owned: int
    """How many of `pages` the context holds tokens in; the rest are its reserve."""
    masked_pages: tuple[int, ...]
    next_slot: int
    """The kv slot the next token is written to (the context's length after the granting pass)."""
    next_position: int
    op: SlotOp
    """The sampler of the pass that granted the lease: staged passes predict it again."""
    adapter: str | None = None
    """The LoRA adapter of the pass that granted the lease: the lease's passes run through it."""


@frozen(kw_only=True)
class LanePassApplied:
    """A pass run on a lease was handed to its program: the context now holds `token`.

    `staged` says the pass was run ahead of the program's request (a hit); otherwise it ran on
    request. The kv actor appends the token at the context's end, taking the next reserved page
    when the token starts one (`page`).
    """

    lease: int
    context: int
    corr: int
    token: int
    position: int
    page: int
    staged: bool
    outputs: tuple[SlotOutput, ...]


@frozen(kw_only=True)
class LanePassesApplied:
    """The `LanePassApplied` of one forward pass's lanes, in order: one event per pass rather
    than one per token, so the kv actor and the event log keep up with many lanes."""

    passes: tuple[LanePassApplied, ...]


@frozen(kw_only=True)
class LeaseReleased:
    """No pass of the lease runs or will run: its pages are unpinned."""

    lease: int
    context: int
