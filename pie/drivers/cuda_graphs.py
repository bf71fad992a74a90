"""CUDA graphs of decode passes: one per batch-size bucket, captured at start-up over static
input buffers. A decode pass of n requests replays the smallest bucket holding n, padded with
requests that attend and write one slot of a scratch page no context owns."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pie.drivers.models.base import CausalLM
from pie.drivers.paged_kernels import PagedKernelAttention, PagedKernels, PlannedGroup
from pie.drivers.paged_plan import GroupKind, PagedGroup, bucket_for, padded_decode

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_buckets(configured: Sequence[int], max_batch_requests: int) -> tuple[int, ...]:
    """The batch sizes to capture: the configured ones (or the defaults) up to the largest
    pass, and that largest pass itself, so every decode pass has a bucket."""
    chosen = configured or DEFAULT_BUCKETS
    if any(size < 1 for size in chosen):
        raise ValueError(f"graph batch sizes must be >= 1, got {list(chosen)}")
    kept = {size for size in chosen if size < max_batch_requests}
    return tuple(sorted(kept | {max_batch_requests}))


class DecodeGraph:
    """The decode pass of exactly `size` requests over static buffers: token ids, positions and
    KV write rows, and the decode wrapper's index arrays. `replay` runs the captured graph, or
    the same pass eagerly before (or without) a capture."""

    def __init__(
        self,
        model: CausalLM,
        kernels: PagedKernels,
        *,
        size: int,
        scratch_page: int,
        max_indices: int,
    ) -> None:
        device = kernels.device
        self.model = model
        self.kernels = kernels
        self.size = size
        self.scratch_page = scratch_page
        self.max_indices = max_indices
        self.inputs = torch.zeros((3, size), dtype=torch.long, device=device)
        self.host = torch.zeros((3, size), dtype=torch.long, pin_memory=device.type == "cuda")
        self.buffers = (
            torch.zeros(size + 1, dtype=torch.int32, device=device),
            torch.zeros(max_indices, dtype=torch.int32, device=device),
            torch.zeros(size, dtype=torch.int32, device=device),
        )
        self.wrapper = kernels.decode_wrapper(self.buffers)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def fits(self, group: PagedGroup) -> bool:
        return group.num_requests <= self.size and len(group.kv_indices) < self.max_indices

    def prepare(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        rows: Sequence[int],
        group: PagedGroup,
        chained: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Fills the static buffers for `group` (its requests in batch order) and plans it;
        `chained` (token indices, device tokens) overwrites those tokens on the device. The
        caller waits first for the copies of the last pass prepared (CudaDriver._prepare): the
        device may still be reading `host` and the plan's host buffers for an earlier pass."""
        n = len(tokens)
        pad = self.size - n
        scratch_row = self.scratch_page * 2 * self.kernels.cache.page_size
        self.host.copy_(
            torch.tensor(
                [
                    [*tokens, *[0] * pad],
                    [*positions, *[0] * pad],
                    [*rows, *[scratch_row] * pad],
                ],
                dtype=torch.long,
            )
        )
        self.inputs.copy_(self.host, non_blocking=True)
        if chained is not None:
            self.inputs[0].index_copy_(0, *chained)
        self.kernels.plan_decode(self.wrapper, *padded_decode(group, self.size, self.scratch_page))

    def _forward(self) -> torch.Tensor:
        planned = [PlannedGroup(self.wrapper)]
        attention = PagedKernelAttention(self.kernels.cache, self.inputs[2], planned)
        hidden = self.model(self.inputs[0], self.inputs[1], attention)
        return self.model.compute_logits(hidden)

    def capture(self, pool: _POOL_HANDLE) -> None:
        """Captures the pass, with every request a padding one while capturing."""
        self.prepare([], [], [], PagedGroup(kind=GroupKind.DECODE))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward()  # kernels load and the allocator warms before the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.logits = self._forward()
        self.graph = graph

    def replay(self) -> torch.Tensor:
        """Logits [size, vocab] of the prepared pass."""
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        assert self.logits is not None
        return self.logits


class DecodeGraphs:
    """One DecodeGraph per bucket; `capture` records them all (largest first, so the smaller
    ones reuse its memory pool)."""

    def __init__(
        self,
        model: CausalLM,
        kernels: PagedKernels,
        *,
        buckets: Sequence[int],
        scratch_page: int,
        max_pages_per_request: int,
    ) -> None:
        self.buckets = tuple(sorted(buckets))
        self.graphs = {
            size: DecodeGraph(
                model,
                kernels,
                size=size,
                scratch_page=scratch_page,
                max_indices=size * max_pages_per_request + 1,
            )
            for size in self.buckets
        }
        self.captured = False

    def for_group(self, group: PagedGroup) -> DecodeGraph | None:
        size = bucket_for(group.num_requests, self.buckets)
        if size is None:
            return None
        graph = self.graphs[size]
        return graph if graph.fits(group) else None

    def capture(self, announce: bool = True) -> float:
        """Captures every bucket; returns the seconds it took."""
        started = time.perf_counter()
        if announce:
            print(
                f"pie: capturing CUDA graphs for decode batch sizes {list(self.buckets)}...",
                file=sys.stderr,
                flush=True,
            )
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self.graphs[size].capture(pool)
        torch.cuda.synchronize()
        self.captured = True
        seconds = time.perf_counter() - started
        if announce:
            print(
                f"pie: {len(self.buckets)} CUDA graphs captured in {seconds:.1f} s", file=sys.stderr
            )
        return seconds
