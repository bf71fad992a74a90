"""Paged attention for one batch on plain torch: index tensors and masks built once per batch,
then for every layer a KV write and one padded scaled_dot_product_attention per request group."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from attrs import frozen

from pie.drivers.batch import ForwardBatch
from pie.drivers.kvcache import PagedKvCache
from pie.events.sampling import Rle


def rle_rows(masks: Sequence[Rle], width: int) -> torch.Tensor:
    """Expands run-length masks into a [len(masks), width] bool tensor, one mask per row.

    A mask shorter than `width` is padded with False. Each mask must add up to <= width.
    """
    out = torch.zeros((len(masks), width), dtype=torch.bool)
    if not masks:
        return out
    runs = torch.tensor([run for mask in masks for run in mask], dtype=torch.long)
    values = torch.tensor([i % 2 == 0 for mask in masks for i in range(len(mask))])
    bits = torch.repeat_interleave(values, runs)
    lengths = torch.tensor([sum(mask) for mask in masks], dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(masks)), lengths)
    start = torch.cumsum(lengths, 0) - lengths
    out[row, torch.arange(bits.numel()) - start[row]] = bits
    return out


@frozen
class _Group:
    """Requests with the same number of new tokens, attended in one padded call.

    tokens: flat token indices [B * n]; k_rows, v_rows: cache rows of every slot [B * L]
    (padding points at row 0 and is masked); mask: [B, 1, n, L] or None when all visible;
    blind: [B, 1, n, 1] for tokens that see no slot, or None when there are none.
    """

    batch: int
    new_tokens: int
    kv_len: int
    tokens: torch.Tensor
    k_rows: torch.Tensor
    v_rows: torch.Tensor
    mask: torch.Tensor | None
    blind: torch.Tensor | None


class _GroupBuilder:
    """Builds one _Group on the CPU from the batch's lists, vectorised over its requests."""

    def __init__(self, batch: ForwardBatch, cache: PagedKvCache, requests: list[int]) -> None:
        self.batch = batch
        self.page_size = cache.page_size
        self.requests = requests
        self.n = batch.qo_indptr[requests[0] + 1] - batch.qo_indptr[requests[0]]
        self.kv_lens = torch.tensor([batch.kv_lens[r] for r in requests], dtype=torch.long)
        self.width = int(self.kv_lens.max())
        self.num_pages = -(-self.width // self.page_size)
        self.slot = torch.arange(self.width)
        self.slot_page = self.slot // self.page_size

    def pages(self, r: int) -> list[int]:
        b = self.batch
        return b.kv_page_indices[b.kv_page_indptr[r] : b.kv_page_indptr[r + 1]]

    def k_rows(self) -> torch.Tensor:
        """[B, L] cache row of each request's slot j."""
        table = torch.zeros((len(self.requests), self.num_pages), dtype=torch.long)
        for i, r in enumerate(self.requests):
            pages = self.pages(r)[: self.num_pages]
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        return table[:, self.slot_page] * (2 * self.page_size) + self.slot % self.page_size

    def token_slots(self) -> torch.Tensor:
        """[B, n] kv slot of each new token."""
        return self.kv_lens[:, None] - self.n + torch.arange(self.n)[None, :]

    def visible(self) -> torch.Tensor:
        """[B, n, L]: causal by slot, then custom masks and masked pages."""
        seen = self.slot[None, None, :] <= self.token_slots()[:, :, None]
        shown_pages = torch.ones((len(self.requests), self.num_pages), dtype=torch.bool)
        for i, r in enumerate(self.requests):
            masked = [p for p in self.batch.masked_pages[r] if p < self.num_pages]
            shown_pages[i, masked] = False
            custom = self.batch.attention_masks[r]
            if custom is not None:
                seen[i] &= rle_rows(custom, self.width)
        return seen & shown_pages[:, self.slot_page][:, None, :]

    def build(self, device: torch.device) -> tuple[_Group, torch.Tensor, torch.Tensor]:
        """The group, its flat token indices, and the K rows those tokens are written to."""
        k_rows = self.k_rows()
        visible = self.visible()
        starts = torch.tensor([self.batch.qo_indptr[r] for r in self.requests])
        tokens = (starts[:, None] + torch.arange(self.n)[None, :]).reshape(-1)
        write_rows = k_rows.gather(1, self.token_slots()).reshape(-1)
        blind = ~visible.any(-1)
        group = _Group(
            batch=len(self.requests),
            new_tokens=self.n,
            kv_len=self.width,
            tokens=tokens.to(device),
            k_rows=k_rows.reshape(-1).to(device),
            v_rows=(k_rows + self.page_size).reshape(-1).to(device),
            mask=None if bool(visible.all()) else visible[:, None].to(device),
            blind=blind[:, None, :, None].to(device) if bool(blind.any()) else None,
        )
        return group, tokens, write_rows


def _group_requests(batch: ForwardBatch) -> list[list[int]]:
    """Requests bucketed by their number of new tokens, so decode steps share one call."""
    buckets: dict[int, list[int]] = {}
    for r in range(batch.num_requests):
        buckets.setdefault(batch.qo_indptr[r + 1] - batch.qo_indptr[r], []).append(r)
    return list(buckets.values())


class PagedAttention:
    """The AttentionFn of one batch: writes each layer's new K/V, then attends over the pages.

    Built once per batch; every layer reuses the same index tensors and masks. GQA goes through
    scaled_dot_product_attention's enable_gqa, which on this CPU matched folding the query
    heads of a KV head into the query length and beat repeat_interleave of K/V by about 2.5x.
    """

    def __init__(
        self, batch: ForwardBatch, cache: PagedKvCache, *, scale: float | None = None
    ) -> None:
        self.cache = cache
        self.scale = scale
        self.groups: list[_Group] = []
        write_rows = torch.zeros(batch.num_tokens, dtype=torch.long)
        for requests in _group_requests(batch):
            group, tokens, rows = _GroupBuilder(batch, cache, requests).build(cache.device)
            write_rows[tokens] = rows
            self.groups.append(group)
        self.write_rows = write_rows.to(cache.device)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.cache.write(layer, self.write_rows, k, v)
        rows = self.cache.layer_rows(layer)
        if len(self.groups) == 1:
            return self._attend(self.groups[0], q, rows)
        out = torch.empty_like(q)
        for group in self.groups:
            out.index_copy_(0, group.tokens, self._attend(group, q, rows))
        return out

    def _attend(self, g: _Group, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = rows.shape[1]
        qg = q.index_select(0, g.tokens).view(g.batch, g.new_tokens, heads, dim).transpose(1, 2)
        kg = rows.index_select(0, g.k_rows).view(g.batch, g.kv_len, kv_heads, dim).transpose(1, 2)
        vg = rows.index_select(0, g.v_rows).view(g.batch, g.kv_len, kv_heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qg.to(rows.dtype), kg, vg, attn_mask=g.mask, scale=self.scale, enable_gqa=True
        )
        if g.blind is not None:
            # Backends differ on rows with nothing visible (NaN or zeros); pin them to zeros.
            out = out.masked_fill(g.blind, 0.0)
        return out.transpose(1, 2).reshape(-1, heads, dim).to(q.dtype)
