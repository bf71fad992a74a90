"""The one batched request type that crosses into a driver, flattened the flashinfer way."""

from __future__ import annotations

from collections.abc import Sequence

from attrs import define, field

from pie.events.forward import ForwardRequest, MediaRun
from pie.events.sampling import LogitBias, Penalty, Rle, SlotOp


@define(kw_only=True)
class ForwardBatch:
    """Flat token ids and positions with CSR offsets per request.

    Request r owns tokens [qo_indptr[r], qo_indptr[r+1]) and pages
    kv_page_indices[kv_page_indptr[r]:kv_page_indptr[r+1]]; after the pass its kv length is
    kv_lens[r], and its new tokens fill kv slots [kv_lens[r] - n_r, kv_lens[r]).
    """

    token_ids: list[int] = field(factory=list)
    positions: list[int] = field(factory=list)
    qo_indptr: list[int] = field(factory=lambda: [0])
    kv_page_indptr: list[int] = field(factory=lambda: [0])
    kv_page_indices: list[int] = field(factory=list)
    kv_lens: list[int] = field(factory=list)
    masked_pages: list[tuple[int, ...]] = field(factory=list)
    attention_masks: list[tuple[Rle, ...] | None] = field(factory=list)
    logit_masks: list[Rle | None] = field(factory=list)
    logit_biases: list[tuple[LogitBias, ...]] = field(factory=list)
    penalties: list[Penalty | None] = field(factory=list)
    adapters: list[str | None] = field(factory=list)
    """For each request, the LoRA adapter its tokens run through (None: the base model)."""
    slot_requests: list[int] = field(factory=list)
    """For each sampling slot, the request it belongs to."""
    slot_tokens: list[int] = field(factory=list)
    """For each sampling slot, the flat index of the token whose logits it reads."""
    slot_ops: list[SlotOp] = field(factory=list)
    copies: list[tuple[int, int]] = field(factory=list)
    media: list[tuple[int, MediaRun]] = field(factory=list)
    """(flat index of the run's first token, run): tokens read from media encoder output."""
    chained: list[tuple[int, int]] = field(factory=list)
    """(flat index of a token, sampling slot of an earlier pass, the one `launch` is given): the
    token that slot samples, written into this pass's inputs on the device before it runs (its
    entry in `token_ids` is a placeholder). See TorchDriver.launch."""

    @property
    def num_requests(self) -> int:
        return len(self.kv_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_requests(cls, requests: Sequence[ForwardRequest]) -> ForwardBatch:
        batch = cls()
        for req in requests:
            batch.add(req)
        return batch

    def add(self, req: ForwardRequest) -> None:
        base = len(self.token_ids)
        r = len(self.kv_lens)
        self.token_ids.extend(req.tokens)
        self.positions.extend(req.positions)
        self.qo_indptr.append(len(self.token_ids))
        self.kv_page_indices.extend(req.pages)
        self.kv_page_indptr.append(len(self.kv_page_indices))
        self.kv_lens.append(req.kv_len)
        self.masked_pages.append(req.masked_pages)
        self.attention_masks.append(req.attention_masks)
        self.logit_masks.append(req.logit_mask)
        self.logit_biases.append(req.logit_bias)
        self.penalties.append(req.penalty)
        self.adapters.append(req.adapter)
        for slot in req.slots:
            self.slot_requests.append(r)
            self.slot_tokens.append(base + slot.index)
            self.slot_ops.append(slot.op)
        self.copies.extend((c.src, c.dst) for c in req.copies)
        self.media.extend((base + run.index, run) for run in req.media)

    def add_decode(
        self,
        token: int,
        position: int,
        pages: tuple[int, ...],
        kv_len: int,
        masked_pages: tuple[int, ...],
        op: SlotOp,
        adapter: str | None = None,
        chained_from: int | None = None,
    ) -> None:
        """One token with one sampling slot on it: what a lane pass runs. With `chained_from`,
        the token is what that slot of the previous pass samples (`token` is a placeholder)."""
        if chained_from is not None:
            self.chained.append((len(self.token_ids), chained_from))
        self.slot_tokens.append(len(self.token_ids))
        self.slot_requests.append(len(self.kv_lens))
        self.slot_ops.append(op)
        self.token_ids.append(token)
        self.positions.append(position)
        self.qo_indptr.append(len(self.token_ids))
        self.kv_page_indices.extend(pages)
        self.kv_page_indptr.append(len(self.kv_page_indices))
        self.kv_lens.append(kv_len)
        self.masked_pages.append(masked_pages)
        self.attention_masks.append(None)
        self.logit_masks.append(None)
        self.logit_biases.append(())
        self.penalties.append(None)
        self.adapters.append(adapter)
