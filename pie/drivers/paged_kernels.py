"""Paged attention on flashinfer's wrappers: one decode and two prefill wrappers (causal and
custom mask) planned once per pass from CPU index arrays and reused by every layer, and the
AttentionFn that writes each layer's new K/V and runs the planned groups."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from pie.drivers.host_copies import device_tensor, to_device
from pie.drivers.kvcache import PagedKvCache
from pie.drivers.paged_plan import AttentionPlan, GroupKind, PagedGroup

WORKSPACE_BYTES = 256 * 1024 * 1024
"""flashinfer's float workspace (split-kv partial results), shared by the wrappers, which run
one after another on one stream."""


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class PagedKernels:
    """The wrappers of one KV cache. `kernels` is the flashinfer module (or anything with the
    same two wrapper classes); planning reads CPU tensors, so it never waits for the device."""

    def __init__(
        self,
        kernels: ModuleType | Any,
        cache: PagedKvCache,
        *,
        num_heads: int,
        device: torch.device,
    ) -> None:
        self.kernels = kernels
        self.cache = cache
        self.num_heads = num_heads
        self.device = device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrappers: dict[GroupKind, Any] = {
            GroupKind.DECODE: self.decode_wrapper(),
            GroupKind.CAUSAL: self.prefill_wrapper(),
            GroupKind.CUSTOM: self.prefill_wrapper(),
        }

    def decode_wrapper(self, graph_buffers: tuple[torch.Tensor, ...] | None = None) -> Any:
        """A decode wrapper; with graph_buffers (indptr, indices, last_page_len) one whose
        index arrays live at fixed addresses, as a captured CUDA graph needs."""
        if graph_buffers is None:
            return self.kernels.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend="fa2"
            )
        indptr, indices, last_page_len = graph_buffers
        return self.kernels.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len,
            backend="fa2",
        )

    def prefill_wrapper(self) -> Any:
        return self.kernels.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2"
        )

    def _shape(self) -> tuple[int, int, int, int]:
        shape = self.cache.shape
        return self.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size

    def plan_decode(
        self, wrapper: Any, indptr: list[int], indices: list[int], last_page_len: list[int]
    ) -> None:
        dtype = self.cache.shape.dtype
        wrapper.plan(
            _ints(indptr),
            # On the device already: a graph wrapper copies host indices into its buffer with a
            # blocking copy, which would wait for the passes queued before this one.
            to_device(_ints(indices), self.device),
            _ints(last_page_len),
            *self._shape(),
            q_data_type=dtype,
            kv_data_type=dtype,
        )

    def plan_group(self, group: PagedGroup) -> Any:
        """Plans the wrapper of the group's kind for it and returns that wrapper."""
        wrapper = self.wrappers[group.kind]
        if group.kind is GroupKind.DECODE:
            self.plan_decode(wrapper, group.kv_indptr, group.kv_indices, group.last_page_len)
            return wrapper
        mask = None
        if group.kind is GroupKind.CUSTOM:
            mask = to_device(group.flat_mask(), self.device)
        dtype = self.cache.shape.dtype
        wrapper.plan(
            _ints(group.qo_indptr),
            _ints(group.kv_indptr),
            _ints(group.kv_indices),
            _ints(group.last_page_len),
            *self._shape(),
            custom_mask=mask,
            causal=group.kind is GroupKind.CAUSAL,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        return wrapper

    def attention(self, plan: AttentionPlan, num_tokens: int) -> PagedKernelAttention:
        """The batch's attention: every group planned, its write rows on the device."""
        rows = device_tensor(plan.write_rows, torch.long, self.device)
        planned = [PlannedGroup.plan(self, group, num_tokens) for group in plan.groups]
        return PagedKernelAttention(self.cache, rows, planned)


class PlannedGroup:
    """A planned wrapper, the device indices of its tokens (None: the whole batch in order)
    and of its tokens that see nothing (None: none do)."""

    def __init__(
        self, wrapper: Any, tokens: torch.Tensor | None = None, blind: torch.Tensor | None = None
    ) -> None:
        self.wrapper = wrapper
        self.tokens = tokens
        self.blind = blind

    @classmethod
    def plan(cls, kernels: PagedKernels, group: PagedGroup, num_tokens: int) -> PlannedGroup:
        def on_device(values: list[int]) -> torch.Tensor:
            return device_tensor(values, torch.long, kernels.device)

        return cls(
            kernels.plan_group(group),
            None if group.is_whole(num_tokens) else on_device(group.tokens),
            on_device(group.blind) if group.blind else None,
        )

    def run(self, q: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        out = self.wrapper.run(q if self.tokens is None else q.index_select(0, self.tokens), pages)
        if self.blind is not None:
            out = out.index_fill(0, self.blind, 0.0)
        return out


class PagedKernelAttention:
    """The AttentionFn of one batch on the paged kernels (see models.base.AttentionFn): each
    layer's new K/V written at `write_rows`, then every group attended."""

    def __init__(
        self, cache: PagedKvCache, write_rows: torch.Tensor, planned: list[PlannedGroup]
    ) -> None:
        self.cache = cache
        self.write_rows = write_rows
        self.planned = planned

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.cache.write(layer, self.write_rows, k, v)
        pages = self.cache.layer(layer)
        q = q.to(pages.dtype)
        if len(self.planned) == 1 and self.planned[0].tokens is None:
            return self.planned[0].run(q, pages)
        out = torch.empty_like(q)
        for group in self.planned:
            assert group.tokens is not None
            out.index_copy_(0, group.tokens, group.run(q, pages))
        return out
