"""How one batch is attended by paged kernels (flashinfer's wrappers): its requests split into
decode, causal and custom-mask groups, each described by the CSR index arrays the kernels plan
from, and the KV row every new token is written to. Host work only: lists, and CPU tensors for the
custom masks."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch
from attrs import define, field, frozen

from pie.drivers.attention import rle_rows
from pie.drivers.batch import ForwardBatch


class GroupKind(Enum):
    DECODE = "decode"
    """One new token per request, seeing every kept page: the decode kernel."""
    CAUSAL = "causal"
    """Several new tokens per request, each seeing the slots up to its own: causal prefill."""
    CUSTOM = "custom"
    """Attention masks, or masked pages the kernels cannot simply leave out: prefill with an
    explicit mask."""


@define(kw_only=True)
class PagedGroup:
    """Requests attended by one kernel call per layer, in the flashinfer CSR form.

    tokens: the batch's flat token indices of the group, request after request.
    qo_indptr: CSR offsets of each request's tokens within `tokens`.
    kv_indptr, kv_indices, last_page_len: the pages each request attends, in order, and how
    many slots of its last page are filled; pages wholly masked are left out where that is
    exact (they lie before the request's first new token).
    masks: for CUSTOM, each request's [new tokens, kv_len] visibility (see `flat_mask`); None
    otherwise.
    blind: indices into `tokens` of tokens that see no slot at all (their output is zero).
    """

    kind: GroupKind
    tokens: list[int] = field(factory=list)
    qo_indptr: list[int] = field(factory=lambda: [0])
    kv_indptr: list[int] = field(factory=lambda: [0])
    kv_indices: list[int] = field(factory=list)
    last_page_len: list[int] = field(factory=list)
    masks: list[torch.Tensor] | None = None
    blind: list[int] = field(factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.last_page_len)

    def flat_mask(self) -> torch.Tensor:
        """The masks flattened row-major and concatenated, as the prefill kernel takes them."""
        assert self.masks is not None, "only a CUSTOM group has masks"
        return torch.cat([mask.reshape(-1) for mask in self.masks])

    def is_whole(self, num_tokens: int) -> bool:
        """Whether the group is every token of the batch in batch order (no gather needed)."""
        return len(self.tokens) == num_tokens and all(t == i for i, t in enumerate(self.tokens))


@frozen(kw_only=True)
class AttentionPlan:
    """The groups of one batch (empty ones left out) and each new token's KV row."""

    groups: tuple[PagedGroup, ...]
    write_rows: tuple[int, ...]
    """Row of each new token's K in a layer's flat [num_pages * 2 * page_size] rows; its V is
    page_size rows further on."""

    @property
    def is_decode_only(self) -> bool:
        return len(self.groups) == 1 and self.groups[0].kind is GroupKind.DECODE


def _request_pages(batch: ForwardBatch, r: int, page_size: int) -> list[int]:
    """The pages that hold request r's kv_len slots (a request may name spare ones after)."""
    pages = batch.kv_page_indices[batch.kv_page_indptr[r] : batch.kv_page_indptr[r + 1]]
    return pages[: -(-batch.kv_lens[r] // page_size)]


def _visibility(batch: ForwardBatch, r: int, page_size: int) -> torch.Tensor:
    """Request r's [n, kv_len] bool mask: causal by slot, custom masks, masked pages."""
    n, kv_len = batch.qo_indptr[r + 1] - batch.qo_indptr[r], batch.kv_lens[r]
    slots = torch.arange(kv_len)
    seen = slots[None, :] <= (kv_len - n + torch.arange(n))[:, None]
    hidden = [p for p in batch.masked_pages[r] if p * page_size < kv_len]
    if hidden:
        shown = torch.ones(-(-kv_len // page_size), dtype=torch.bool)
        shown[hidden] = False
        seen &= shown[slots // page_size][None, :]
    masks = batch.attention_masks[r]
    if masks is not None:
        seen &= rle_rows(masks, kv_len)
    return seen


def _kind(batch: ForwardBatch, r: int, page_size: int) -> GroupKind:
    n = batch.qo_indptr[r + 1] - batch.qo_indptr[r]
    first_new_page = (batch.kv_lens[r] - n) // page_size
    if batch.attention_masks[r] is not None:
        return GroupKind.CUSTOM
    if any(p >= first_new_page for p in batch.masked_pages[r] if p * page_size < batch.kv_lens[r]):
        return GroupKind.CUSTOM
    return GroupKind.DECODE if n == 1 else GroupKind.CAUSAL


def _add(group: PagedGroup, batch: ForwardBatch, r: int, page_size: int) -> None:
    start, end = batch.qo_indptr[r], batch.qo_indptr[r + 1]
    base = len(group.tokens)
    group.tokens.extend(range(start, end))
    group.qo_indptr.append(len(group.tokens))
    pages = _request_pages(batch, r, page_size)
    kv_len = batch.kv_lens[r]
    group.last_page_len.append(kv_len - (len(pages) - 1) * page_size)
    if group.kind is GroupKind.CUSTOM:
        seen = _visibility(batch, r, page_size)
        assert group.masks is not None
        group.masks.append(seen)
        group.blind.extend(base + t for t in (~seen.any(1)).nonzero().view(-1).tolist())
    else:
        hidden = set(batch.masked_pages[r])
        pages = [p for i, p in enumerate(pages) if i not in hidden]
    group.kv_indices.extend(pages)
    group.kv_indptr.append(len(group.kv_indices))


def write_rows(batch: ForwardBatch, page_size: int) -> list[int]:
    """Each new token's K row: token t of request r fills slot kv_len - n + t of its pages."""
    rows: list[int] = []
    for r in range(batch.num_requests):
        start, end = batch.qo_indptr[r], batch.qo_indptr[r + 1]
        pages = batch.kv_page_indices[batch.kv_page_indptr[r] : batch.kv_page_indptr[r + 1]]
        first = batch.kv_lens[r] - (end - start)
        for slot in range(first, first + end - start):
            rows.append(pages[slot // page_size] * 2 * page_size + slot % page_size)
    return rows


def plan_attention(batch: ForwardBatch, page_size: int) -> AttentionPlan:
    """Splits a validated batch into paged-kernel groups (see GroupKind)."""
    groups = {kind: PagedGroup(kind=kind) for kind in GroupKind}
    groups[GroupKind.CUSTOM].masks = []
    for r in range(batch.num_requests):
        _add(groups[_kind(batch, r, page_size)], batch, r, page_size)
    return AttentionPlan(
        groups=tuple(g for g in groups.values() if g.num_requests),
        write_rows=tuple(write_rows(batch, page_size)),
    )


def padded_decode(
    group: PagedGroup, size: int, scratch_page: int
) -> tuple[list[int], list[int], list[int]]:
    """A decode group's (kv_indptr, kv_indices, last_page_len) grown to `size` requests, each
    added request attending one filled slot of the scratch page (what a CUDA graph captured
    for `size` requests runs with fewer)."""
    extra = size - group.num_requests
    assert extra >= 0, "a decode group larger than its graph"
    end = group.kv_indptr[-1]
    return (
        group.kv_indptr + [end + i + 1 for i in range(extra)],
        group.kv_indices + [scratch_page] * extra,
        group.last_page_len + [1] * extra,
    )


def bucket_for(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `size` requests (buckets ascending), or None."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    return None
