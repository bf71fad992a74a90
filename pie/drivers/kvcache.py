"""The paged KV cache of a torch driver: one tensor holding every layer's pages, and the
arithmetic that turns (page, offset) slots into rows of a layer's flat K and V views."""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch
from attrs import frozen


@frozen(kw_only=True)
class KvCacheShape:
    """What one page holds: page_size slots of K and V for every layer."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_page(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        values = self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * elem
        if self.dtype == torch.int8:
            # An int8 page carries a float32 scale per layer, K or V, and head.
            values += self.num_layers * 2 * self.num_kv_heads * 4
        return values


def _mapped_zeros(dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on a fresh anonymous map: unlike the heap, whose freed blocks may already
    be resident, none of its memory is resident until written. The tensor keeps the map."""
    count = math.prod(dims)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(dims)


def pages_for_budget(budget_bytes: int, shape: KvCacheShape) -> int:
    """How many whole pages fit in `budget_bytes`; raises ValueError when not even one does."""
    pages = budget_bytes // shape.bytes_per_page
    if pages < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no page of {shape.bytes_per_page} bytes"
        )
    return int(pages)


class PagedKvCache:
    """KV pages shaped [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim].

    One allocation for all layers so that a page copy is a single index_copy_ across every
    layer, and so that sizing from a memory budget is one number. Each layer's slice is a
    contiguous [num_pages, 2, page_size, heads, dim] tensor, the flashinfer NHD layout, so a
    layer can be handed to a paged kernel as is. Flattened to rows, the K of slot (page p,
    offset o) is row p * 2 * page_size + o and its V is page_size rows further on.

    With `lazy` (host memory only) the pool is an anonymous memory map that nothing writes at
    start: the kernel hands each of its memory pages out zero-filled the first time it is
    touched, so the memory a KV page takes becomes resident only once a pass uses it, and a
    page's unwritten slots hold zeros, as in a pool zeroed at once (a NaN left in reused heap
    memory would survive a zero attention weight). Otherwise the whole pool is zeroed at once.
    """

    def __init__(
        self,
        shape: KvCacheShape,
        num_pages: int,
        device: str | torch.device,
        *,
        lazy: bool = False,
    ) -> None:
        self.shape = shape
        self.num_pages = num_pages
        dims = (shape.num_layers, num_pages, 2, shape.page_size, shape.num_kv_heads, shape.head_dim)
        lazy = lazy and num_pages > 0 and torch.device(device).type == "cpu"
        self.kv = (
            _mapped_zeros(dims, shape.dtype)
            if lazy
            else torch.zeros(dims, dtype=shape.dtype, device=device)
        )
        self._unused = bytearray(b"\x01" * num_pages) if lazy else None
        self._first_unused = 0 if lazy else num_pages
        """Every page below it has been used (the kv actor hands out the lowest ids first, so
        a pass's pages are nearly always below it and the check is one `max`)."""
        if lazy:
            # Padding in a batch's gathers reads page 0: it counts as used from the start.
            self.prepare([0])

    def prepare(self, pages: Sequence[int]) -> None:
        """Notes the pages a pass is about to use, for `used_pages` (a lazy pool's resident
        part)."""
        unused = self._unused
        if unused is None or not pages or max(pages) < self._first_unused:
            return
        fresh = [page for page in set(pages) if unused[page]]
        for page in fresh:
            unused[page] = 0
        first = self._first_unused
        while first < self.num_pages and not unused[first]:
            first += 1
        self._first_unused = first

    @property
    def used_pages(self) -> int:
        """Pages some pass has used (all of them when the pool was zeroed at once)."""
        if self._unused is None:
            return self.num_pages
        return self.num_pages - sum(self._unused)

    @property
    def page_size(self) -> int:
        return self.shape.page_size

    @property
    def bytes_per_page(self) -> int:
        return self.shape.bytes_per_page

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def layer(self, layer: int) -> torch.Tensor:
        """One layer's pages, [num_pages, 2, page_size, heads, dim] (a view)."""
        return self.kv[layer]

    def layer_rows(self, layer: int) -> torch.Tensor:
        """One layer's pages as rows [num_pages * 2 * page_size, heads, dim] (a view)."""
        return self.kv[layer].view(-1, self.shape.num_kv_heads, self.shape.head_dim)

    def slot_rows(self, slot_pages: torch.Tensor, slot_offsets: torch.Tensor) -> torch.Tensor:
        """Row of each slot's K in `layer_rows`; add `page_size` for its V."""
        return slot_pages * (2 * self.page_size) + slot_offsets

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype `gather` returns K and V in."""
        return self.shape.dtype

    def gather(self, layer: int, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """K or V rows [R, heads, dim] of one layer (rows from `slot_rows`), into `out`."""
        return torch.index_select(self.layer_rows(layer), 0, rows, out=out)

    def write(
        self,
        layer: int,
        k_rows: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        v_rows: torch.Tensor | None = None,
    ) -> None:
        """Stores k, v [T, heads, dim] at the slots whose K rows are `k_rows` [T] (and V rows
        `v_rows`, k_rows + page_size when not given: a pass computes them once for its layers)."""
        rows = self.layer_rows(layer)
        rows.index_copy_(0, k_rows, k.to(rows.dtype))
        v_rows = k_rows + self.page_size if v_rows is None else v_rows
        rows.index_copy_(0, v_rows, v.to(rows.dtype))

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies pages src[i] -> dst[i] in every layer; `src` is read before any write."""
        if src.numel() == 0:
            return
        self.kv.index_copy_(1, dst, self.kv.index_select(1, src))
