"""Paged attention for one batch on plain torch: index tensors and masks built once per batch,
then for every layer a KV write and one padded scaled_dot_product_attention per request group
(decode groups on a float32 CPU cache go to a kernel that reads the pages in place instead)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from attrs import frozen

from pie.drivers.batch import ForwardBatch
from pie.drivers.decode_attention import DecodePages, decode_attention, reads_in_place
from pie.drivers.kvcache import PagedKvCache
from pie.drivers.models.base import PLAIN_ATTENTION, LayerAttention
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
class _Mask:
    """What one group's tokens see under one layer kind: mask [B, 1, n, L], or None when all is
    visible or when `causal` says the plain causal mask of a fresh prefill (kv_len == n) applies;
    blind [B, 1, n, 1] for tokens that see no slot, or None when there are none."""

    mask: torch.Tensor | None
    causal: bool
    blind: torch.Tensor | None


@frozen
class _Group:
    """Requests with the same number of new tokens, attended in one padded call.

    tokens: flat token indices [B * n]; k_rows, v_rows: cache rows of every slot [B * L]
    (padding points at row 0 and is masked); masks: the visibility for each sliding window the
    model's layers use (None: the full causal kind); keys, values: gather buffers [B * L, ...]
    reused by every layer, because a fresh multi-MB tensor per layer costs page faults on the
    CPU (measured: 1.2 ms per decode layer became 5 ms). A decode group that the kernel attends
    in place has `pages` instead, and no masks or buffers.
    """

    batch: int
    new_tokens: int
    kv_len: int
    tokens: torch.Tensor
    k_rows: torch.Tensor
    v_rows: torch.Tensor
    masks: dict[int | None, _Mask]
    keys: torch.Tensor
    values: torch.Tensor
    pages: DecodePages | None = None


class _GroupBuilder:
    """Builds one _Group on the CPU from the batch's lists, vectorised over its requests."""

    def __init__(self, batch: ForwardBatch, cache: PagedKvCache, requests: list[int]) -> None:
        self.batch = batch
        self.page_size = cache.page_size
        self.cache_shape = cache.shape
        self.value_dtype = cache.value_dtype
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

    def page_table(self) -> torch.Tensor:
        """[B, P] each request's first P pages in order, padded with page 0."""
        width = self.num_pages
        table = [(self.pages(r)[:width] + [0] * width)[:width] for r in self.requests]
        return torch.tensor(table, dtype=torch.long)

    def k_rows(self, table: torch.Tensor) -> torch.Tensor:
        """[B, L] cache row of each request's slot j."""
        return table[:, self.slot_page] * (2 * self.page_size) + self.slot % self.page_size

    def token_slots(self) -> torch.Tensor:
        """[B, n] kv slot of each new token."""
        return self.kv_lens[:, None] - self.n + torch.arange(self.n)[None, :]

    def visible(self) -> torch.Tensor:
        """[B, n, L]: causal by slot, then custom masks and masked pages."""
        seen = self.slot[None, None, :] <= self.token_slots()[:, :, None]
        hidden = [
            (i, p)
            for i, r in enumerate(self.requests)
            for p in self.batch.masked_pages[r]
            if p < self.num_pages
        ]
        if hidden:
            shown = torch.ones((len(self.requests), self.num_pages), dtype=torch.bool)
            shown[[i for i, _ in hidden], [p for _, p in hidden]] = False
            seen &= shown[:, self.slot_page][:, None, :]
        for i, r in enumerate(self.requests):
            custom = self.batch.attention_masks[r]
            if custom is not None:
                seen[i] &= rle_rows(custom, self.width)
        return seen

    def gather_buffer(self, device: torch.device, empty: bool = False) -> torch.Tensor:
        shape = self.cache_shape
        rows = 0 if empty else len(self.requests) * self.width
        size = (rows, shape.num_kv_heads, shape.head_dim)
        return torch.empty(size, dtype=self.value_dtype, device=device)

    def decode_pages(self, table: torch.Tensor) -> DecodePages:
        """What the in-place kernel reads; `visible` [B, 1, L] goes along only when some slot
        below a request's kv_len is hidden (a masked page, a custom mask)."""
        b = self.batch
        hidden = any(b.masked_pages[r] or b.attention_masks[r] is not None for r in self.requests)
        return DecodePages(
            table=table, kv_lens=self.kv_lens, visible=self.visible()[:, 0] if hidden else None
        )

    def plain_causal(self) -> bool:
        """Fresh prefills with no masks: SDPA's own causal mask is exactly right."""
        b = self.batch
        return self.n > 1 and all(
            b.kv_lens[r] == self.n and not b.masked_pages[r] and b.attention_masks[r] is None
            for r in self.requests
        )

    def windowed(self, visible: torch.Tensor, window: int | None) -> torch.Tensor:
        """visible, further limited to the last `window` slots up to each token's own."""
        if window is None or self.width <= window:
            return visible
        return visible & (self.slot[None, None, :] > self.token_slots()[:, :, None] - window)

    def mask(self, visible: torch.Tensor, causal: bool, device: torch.device) -> _Mask:
        blind = ~visible.any(-1)
        return _Mask(
            mask=None if causal or bool(visible.all()) else visible[:, None].to(device),
            causal=causal,
            blind=blind[:, None, :, None].to(device) if bool(blind.any()) else None,
        )

    def build(
        self, device: torch.device, windows: set[int | None], in_place: bool
    ) -> tuple[_Group, torch.Tensor, torch.Tensor]:
        """The group, its flat token indices, and the K rows those tokens are written to. With
        `in_place` (a CPU cache the kernel reads) a decode group carries its pages instead of
        gather rows, masks and buffers."""
        table = self.page_table()
        k_rows = self.k_rows(table)
        starts = torch.tensor([self.batch.qo_indptr[r] for r in self.requests])
        tokens = (starts[:, None] + torch.arange(self.n)[None, :]).reshape(-1)
        write_rows = k_rows.gather(1, self.token_slots()).reshape(-1)
        pages = self.decode_pages(table) if in_place and self.n == 1 else None
        causal = self.plain_causal()
        masks = {}
        if pages is None:  # only the gathered path needs the [B, n, L] visibility for masks
            visible = self.visible()
            for window in windows:
                seen = self.windowed(visible, window)
                masks[window] = self.mask(seen, causal and seen is visible, device)
        group = _Group(
            batch=len(self.requests),
            new_tokens=self.n,
            kv_len=self.width,
            tokens=tokens.to(device),
            k_rows=k_rows.reshape(-1).to(device),
            v_rows=(k_rows + self.page_size).reshape(-1).to(device),
            masks=masks,
            keys=self.gather_buffer(device, empty=pages is not None),
            values=self.gather_buffer(device, empty=pages is not None),
            pages=pages,
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

    Built once per batch; every layer reuses the same index tensors and masks (one mask per
    distinct sliding window among `layers`, the model's per-layer options). GQA: for decode
    groups the query heads sharing a KV head become that head's query rows (the [B, 1, 1, L]
    mask broadcasts over them), which on this CPU beat enable_gqa=True 6x in bf16, tied it in
    fp32, and beat repeat_interleave of K/V 2x; multi-token groups use enable_gqa=True, as
    folding would need a mask tiled per query head and was no faster for prefill.

    On a float32 CPU cache, decode groups skip all that: a compiled kernel reads each request's
    pages where they lie (`in_place_decode=False` keeps the gather, as on other caches).
    """

    def __init__(
        self,
        batch: ForwardBatch,
        cache: PagedKvCache,
        layers: Sequence[LayerAttention] = (),
        *,
        in_place_decode: bool = True,
    ) -> None:
        self.cache = cache
        self.layers = tuple(layers)
        windows = {spec.sliding_window for spec in self.layers} | {None}
        in_place = in_place_decode and reads_in_place(cache)
        self.groups: list[_Group] = []
        write_rows = torch.zeros(batch.num_tokens, dtype=torch.long)
        tokens = torch.empty(0, dtype=torch.long)
        for requests in _group_requests(batch):
            builder = _GroupBuilder(batch, cache, requests)
            group, tokens, rows = builder.build(cache.device, windows, in_place)
            write_rows[tokens] = rows
            self.groups.append(group)
        self.write_rows = write_rows.to(cache.device)
        self.write_v_rows = self.write_rows + cache.page_size
        # One group holding every token in order (every decode step of one kind): its layers
        # read q as it is instead of selecting its rows.
        self.whole = len(self.groups) == 1 and torch.equal(tokens, torch.arange(batch.num_tokens))

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.cache.write(layer, self.write_rows, k, v, self.write_v_rows)
        spec = self.layers[layer] if layer < len(self.layers) else PLAIN_ATTENTION
        if len(self.groups) == 1:
            return self._attend(self.groups[0], q, layer, spec)
        out = torch.empty_like(q)
        for group in self.groups:
            out.index_copy_(0, group.tokens, self._attend(group, q, layer, spec))
        return out

    def _attend(self, g: _Group, q: torch.Tensor, layer: int, spec: LayerAttention) -> torch.Tensor:
        rows = q if self.whole else q.index_select(0, g.tokens)
        if g.pages is not None:
            return decode_attention(self.cache, layer, rows, g.pages, spec)
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = self.cache.shape.num_kv_heads
        qg = rows.view(g.batch, g.new_tokens, heads, dim).transpose(1, 2)
        fold = g.new_tokens == 1
        if fold:
            qg = qg.reshape(g.batch, kv_heads, -1, dim)
        kg = self.cache.gather(layer, g.k_rows, g.keys)
        vg = self.cache.gather(layer, g.v_rows, g.values)
        kg = kg.view(g.batch, g.kv_len, kv_heads, dim).transpose(1, 2)
        vg = vg.view(g.batch, g.kv_len, kv_heads, dim).transpose(1, 2)
        seen = g.masks[spec.sliding_window]
        if spec.softcap is None:
            out = F.scaled_dot_product_attention(
                qg.to(kg.dtype),
                kg,
                vg,
                attn_mask=seen.mask,
                is_causal=seen.causal,
                scale=spec.scale,
                enable_gqa=not fold,
            )
        else:
            out = softcapped_attention(qg.to(kg.dtype), kg, vg, seen, spec)
        out = out.reshape(g.batch, heads, g.new_tokens, dim)
        if seen.blind is not None:
            # Backends differ on rows with nothing visible (NaN or zeros); pin them to zeros.
            out = out.masked_fill(seen.blind, 0.0)
        return out.transpose(1, 2).reshape(-1, heads, dim).to(q.dtype)


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: _Mask, spec: LayerAttention
) -> torch.Tensor:
    """Softmax attention with scores capped by softcap * tanh(s / softcap), which SDPA lacks.
    q [B, Hq, n, D] (or decode-folded [B, Hkv, g, D]); k, v [B, Hkv, L, D]."""
    assert spec.softcap is not None
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if seen.causal:
        n, length = scores.shape[-2:]
        seen_mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
        scores = scores.masked_fill(~seen_mask, float("-inf"))
    elif seen.mask is not None:
        scores = scores.masked_fill(~seen.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v.float()).to(q.dtype)
