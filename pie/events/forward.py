"""A forward pass request once the kv actor has placed it in pages: what the scheduler
batches and the inference actor hands to the driver."""

from __future__ import annotations

from attrs import frozen

from pie.events.sampling import LogitBias, Penalty, Rle, SamplingSlot
from pie.events.speculation import Lease


@frozen(kw_only=True)
class PageCopy:
    """Copy page `src`'s KV into page `dst` before the pass (copy-on-write of a shared tail)."""

    src: int
    dst: int


@frozen(kw_only=True)
class MediaRun:
    """Tokens [index, index + count) of a pass are soft tokens: rows [offset, offset + count)
    of the encoder output of the media whose content hash is `media` (the engine's media
    store holds it for the context's model)."""

    index: int
    count: int
    media: str
    offset: int = 0


def split_media(runs: tuple[MediaRun, ...], start: int, end: int) -> tuple[MediaRun, ...]:
    """The parts of `runs` among tokens [start, end), indexed from `start`."""
    parts = []
    for run in runs:
        lo, hi = max(run.index, start), min(run.index + run.count, end)
        if lo < hi:
            offset = run.offset + lo - run.index
            parts.append(MediaRun(index=lo - start, count=hi - lo, media=run.media, offset=offset))
    return tuple(parts)


@frozen(kw_only=True)
class ForwardRequest:
    """One context's input tokens for one pass, with everything the driver needs to place them.

    The new tokens occupy kv slots [kv_start, kv_start + len(tokens)) of the context, i.e.
    slot i lives in page pages[i // page_size] at offset i % page_size.
    """

    corr: int
    requester: str
    context: int
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    kv_start: int
    pages: tuple[int, ...]
    masked_pages: tuple[int, ...] = ()
    """Indices into `pages` whose slots no token of this pass attends to."""
    attention_masks: tuple[Rle, ...] | None = None
    """Per input token, a mask over kv slots [0, kv_start + i + 1); None means causal."""
    logit_mask: Rle | None = None
    """A mask over the vocabulary applied before every slot's sampler or probe."""
    logit_bias: tuple[LogitBias, ...] = ()
    """Added to every slot's logits before the mask."""
    penalty: Penalty | None = None
    """Presence and frequency penalties for every slot, applied after the biases."""
    slots: tuple[SamplingSlot, ...] = ()
    copies: tuple[PageCopy, ...] = ()
    final: bool = True
    """False for every chunk but the last when the scheduler split a long prefill."""
    slot_positions: tuple[int, ...] = ()
    """Where each of `slots` stood in the unsplit request (empty: in order)."""
    adapter: str | None = None
    """The LoRA adapter (by name) the tokens run through; None: the base model."""
    lease: Lease | None = None
    """Granted when the pass ends in a token sampler: the context's next plain decodes may run
    on the driver thread's fast path."""
    media: tuple[MediaRun, ...] = ()
    """Tokens whose input is a media encoder's output instead of their embedding."""

    @property
    def kv_len(self) -> int:
        return self.kv_start + len(self.tokens)
