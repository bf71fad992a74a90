"""Released pages: which pages of a chain may be released (and which an attention window
releases), and the compact form of a request or lease that the driver sees, with the released
pages' slots taken out so that it attends over the pages still held."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from attrs import evolve

from pie.actors.kv.context import RELEASED, Chain
from pie.actors.kv.validation import RequestError
from pie.events.forward import ForwardRequest
from pie.events.kv import AttentionWindow
from pie.events.sampling import Rle, bools_to_rle, rle_to_bools

MAX_WINDOW_PAGES = 1 << 20


def check_release(chain: Chain, pages: Sequence[int], page_size: int) -> None:
    """Refuses pages that are not full and written (the tail, or a page a pass has not written
    yet): their KV is still needed or not there to free."""
    full = chain.written // page_size
    bad = [p for p in pages if not 0 <= p < full]
    if bad:
        raise RequestError(
            "invalid", f"page indices {bad} are not among the full written pages 0..{full - 1}"
        )


def check_window(window: AttentionWindow) -> None:
    if not 0 <= window.sink_pages <= MAX_WINDOW_PAGES:
        raise RequestError("invalid", f"sink_pages must be 0..{MAX_WINDOW_PAGES}")
    if not 1 <= window.window_pages <= MAX_WINDOW_PAGES:
        raise RequestError("invalid", f"window_pages must be 1..{MAX_WINDOW_PAGES}")


def model_window(sliding_window: int | None, page_size: int) -> AttentionWindow | None:
    """The page window that keeps every slot a model with this sliding window (in tokens, the
    token's own slot included) can still attend: a pass starting at slot s reads back to slot
    s - window + 1, which lies at most ceil((window - 1) / page_size) pages before s's own."""
    if sliding_window is None:
        return None
    return AttentionWindow(sink_pages=0, window_pages=-(-(sliding_window - 1) // page_size) + 1)


def leaving(chain: Chain, window: AttentionWindow, page_size: int) -> list[int]:
    """The held pages a pass placed now would leave out of the window: after the sinks and
    before the last `window_pages`, counting the page the pass starts writing in."""
    writing = len(chain.tokens) // page_size
    # Pages whose KV is not written (and committed) yet are never released.
    first_kept = min(writing - window.window_pages + 1, chain.written // page_size)
    return [j for j in range(window.sink_pages, first_kept) if chain.pages[j] != RELEASED]


class Compactor:
    """Maps a chain's page indices and kv slots onto the pages it still holds."""

    def __init__(self, released: Sequence[int], page_size: int) -> None:
        self.released = list(released)
        self.page_size = page_size

    def page(self, index: int) -> int:
        return index - bisect.bisect_left(self.released, index)

    @property
    def shift(self) -> int:
        """How many kv slots before the chain's end are released (all released pages are)."""
        return len(self.released) * self.page_size

    def masked(self, masked: Sequence[int]) -> tuple[int, ...]:
        gone = set(self.released)
        return tuple(self.page(j) for j in masked if j not in gone)

    def mask(self, runs: Rle, length: int) -> Rle:
        """A mask over kv slots [0, length) without the released pages' slots."""
        bits = rle_to_bools(runs, length)
        size = self.page_size
        for j in reversed(self.released):
            del bits[j * size : (j + 1) * size]
        return bools_to_rle(bits)

    def request(self, request: ForwardRequest) -> ForwardRequest:
        """The request over held pages only; tokens keep their positions."""
        if not self.released:
            return request
        masks = request.attention_masks
        if masks is not None:
            start = request.kv_start
            masks = tuple(self.mask(m, start + i + 1) for i, m in enumerate(masks))
        return evolve(
            request,
            pages=tuple(p for p in request.pages if p != RELEASED),
            masked_pages=self.masked(request.masked_pages),
            kv_start=request.kv_start - self.shift,
            attention_masks=masks,
        )
