"""A torch driver's KV pages as bytes: each page's K and V of every layer (and, for an int8
cache, its scales), page after page, for copying a named snapshot to another node."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pie.drivers.kvcache import PagedKvCache


class CachePages:
    """Reads and writes whole pages of `cache` (a PagedKvCache, int8 or not)."""

    def __init__(self, cache: PagedKvCache, model: str) -> None:
        self.cache = cache
        shape = cache.shape
        self._tensors = [cache.kv, *([cache.scales] if hasattr(cache, "scales") else [])]
        self._widths = [_page_width(t) for t in self._tensors]
        self.page_bytes = sum(self._widths)
        self.layout = (
            f"{model} {type(cache).__name__} {str(shape.dtype).removeprefix('torch.')} "
            f"layers={shape.num_layers} kv_heads={shape.num_kv_heads} "
            f"head_dim={shape.head_dim} page_size={shape.page_size}"
        )

    def export_pages(self, pages: Sequence[int]) -> bytes:
        index = self._index(pages)
        with torch.inference_mode():
            parts = [_rows(t.index_select(1, index)) for t in self._tensors]
            return torch.cat(parts, dim=1).cpu().numpy().tobytes()

    def import_pages(self, pages: Sequence[int], data: bytes) -> None:
        if len(data) != len(pages) * self.page_bytes:
            raise ValueError(f"{len(data)} bytes are not {len(pages)} pages of {self.page_bytes}")
        index = self._index(pages)
        rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(pages), -1)
        rows = rows.to(self.cache.device)
        self.cache.prepare(pages)
        with torch.inference_mode():
            for tensor, part in zip(self._tensors, rows.split(self._widths, dim=1), strict=True):
                values = part.contiguous().view(tensor.dtype)
                values = values.view(len(pages), tensor.shape[0], *tensor.shape[2:])
                tensor.index_copy_(1, index, values.transpose(0, 1))

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        if any(not 0 <= p < self.cache.num_pages for p in pages):
            raise ValueError(f"page index outside 0..{self.cache.num_pages - 1}")
        return torch.tensor(list(pages), dtype=torch.long, device=self.cache.device)


def _page_width(tensor: torch.Tensor) -> int:
    """Bytes one page takes in `tensor` (pages on its dimension 1)."""
    return tensor[:, 0].numel() * tensor.element_size()


def _rows(selected: torch.Tensor) -> torch.Tensor:
    """[layers, n, ...] as n rows of bytes, page-major."""
    count = selected.shape[1]
    return selected.transpose(0, 1).contiguous().view(torch.uint8).view(count, -1)
