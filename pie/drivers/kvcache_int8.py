"""A paged KV cache stored as int8 with one float32 scale per page, K or V, and head: a quarter
of float32's bytes. Writing a token whose values outgrow its page's scale rescales the page."""

from __future__ import annotations

import torch

from pie.drivers.kvcache import KvCacheShape, PagedKvCache

_LEVELS = 127.0


class Int8PagedKvCache(PagedKvCache):
    """`shape.dtype` is int8; K and V come out of `gather` in `value_dtype` (the model's).

    scales[layer, page, kind, head] (kind 0 is K, 1 is V) maps the page's int8 values back:
    x = q * scale. A pass raises a page's scale to cover its new tokens (absmax / 127) and
    re-rounds the tokens already there to the new scale, so a page's first tokens lose a little
    precision when later ones are larger; a page never holds a value it cannot represent."""

    def __init__(
        self,
        shape: KvCacheShape,
        num_pages: int,
        device: str | torch.device,
        *,
        value_dtype: torch.dtype,
        lazy: bool = False,
    ) -> None:
        if shape.dtype != torch.int8:
            raise ValueError(f"an int8 KV cache needs an int8 shape, not {shape.dtype}")
        self._value_dtype = value_dtype
        self._last_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.scales = torch.zeros(
            (shape.num_layers, num_pages, 2, shape.num_kv_heads), dtype=torch.float32, device=device
        )
        super().__init__(shape, num_pages, device, lazy=lazy)

    @property
    def value_dtype(self) -> torch.dtype:
        return self._value_dtype

    def gather(self, layer: int, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        values = torch.index_select(self.layer_rows(layer), 0, rows)
        scales = self._scale_rows(layer).index_select(0, rows // self.page_size)
        return torch.mul(values, scales.unsqueeze(-1), out=out)

    def write(
        self,
        layer: int,
        k_rows: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        v_rows: torch.Tensor | None = None,
    ) -> None:
        blocks, which = self._blocks(k_rows)
        self._write(layer, k_rows, k, blocks, which)
        # A slot's V block is its K block's neighbour (page * 2 + 1).
        v_rows = k_rows + self.page_size if v_rows is None else v_rows
        self._write(layer, v_rows, v, blocks + 1, which)

    def _blocks(self, k_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K blocks (page * 2) the rows fall in, and each row's index among them; worked
        out once per pass, as every layer writes the same rows (the same tensor)."""
        if self._last_rows is not None and self._last_rows[0] is k_rows:
            return self._last_rows[1], self._last_rows[2]
        blocks, which = torch.unique(k_rows // self.page_size, return_inverse=True)
        self._last_rows = (k_rows, blocks, which)
        return blocks, which

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        super().copy_pages(src, dst)
        self.scales.index_copy_(1, dst, self.scales.index_select(1, src))

    def _scale_rows(self, layer: int) -> torch.Tensor:
        """[pages * 2, heads]: the scale of row r is at r // page_size."""
        return self.scales[layer].view(-1, self.shape.num_kv_heads)

    def _write(
        self,
        layer: int,
        rows: torch.Tensor,
        x: torch.Tensor,
        blocks: torch.Tensor,
        which: torch.Tensor,
    ) -> None:
        """Stores x [T, heads, dim] at `rows`, first raising and applying the scales of the
        (page, kind) `blocks` the rows fall in (row i in blocks[which[i]]) where x's magnitude
        needs it."""
        x = x.float()
        heads = self.shape.num_kv_heads
        peaks = x.abs().amax(-1) / _LEVELS
        needed = torch.zeros((len(blocks), heads), device=x.device).scatter_reduce_(
            0, which.unsqueeze(-1).expand(-1, heads), peaks, "amax"
        )
        scale_rows = self._scale_rows(layer)
        old = scale_rows.index_select(0, blocks)
        new = torch.maximum(old, needed)
        grown = (new > old).any(-1)
        if bool(grown.any()):
            self._rescale(layer, blocks[grown], old[grown], new[grown])
        scale_rows.index_copy_(0, blocks, new)
        step = new.index_select(0, which).clamp_min(torch.finfo(torch.float32).tiny)
        quantized = torch.round(x / step.unsqueeze(-1)).clamp_(-_LEVELS, _LEVELS)
        self.layer_rows(layer).index_copy_(0, rows, quantized.to(torch.int8))

    def _rescale(
        self, layer: int, blocks: torch.Tensor, old: torch.Tensor, new: torch.Tensor
    ) -> None:
        """Re-rounds every slot of `blocks` (page * 2 + kind) from scale `old` to `new`."""
        size, heads, dim = self.page_size, self.shape.num_kv_heads, self.shape.head_dim
        values = self.layer_rows(layer).view(-1, size, heads, dim)
        ratio = (old / new).unsqueeze(1).unsqueeze(-1)
        rounded = torch.round(values.index_select(0, blocks).float() * ratio)
        values.index_copy_(0, blocks, rounded.to(torch.int8))
