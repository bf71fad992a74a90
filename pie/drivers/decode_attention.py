"""Decode attention read in place from a float32 paged KV cache on the CPU: the compiled kernel
(kernels/decode_attention.cpp), whether a cache can use it, and the per-batch tensors it takes."""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from attrs import frozen

from pie.drivers.kernels import KernelBuildError, kernel_ops
from pie.drivers.kvcache import PagedKvCache
from pie.drivers.models.base import LayerAttention


@frozen
class DecodePages:
    """A decode group's pages as the kernel reads them, built once per batch: table [B, P] (each
    request's pages in order, padded with page 0), kv_lens [B], and visible [B, L] (None when
    every slot below kv_len is visible; else masked pages and custom masks are False)."""

    table: torch.Tensor
    kv_lens: torch.Tensor
    visible: torch.Tensor | None


@functools.cache
def _kernel() -> Any | None:
    """The kernel's op (the overload itself: the packet costs a lookup per call), or None (said
    once on stderr) when it cannot be built here."""
    try:
        return kernel_ops("attention").decode.default
    except KernelBuildError as e:
        print(f"pie: {e}; decode attention gathers the KV pages instead", file=sys.stderr)
        return None


def reads_in_place(cache: PagedKvCache) -> bool:
    """Whether this cache's decode groups go to the kernel: float32 pages on the CPU that hold
    exactly what `gather` returns (an int8 cache's gather dequantizes), and a kernel that builds."""
    return (
        cache.device.type == "cpu"
        and cache.kv.dtype == torch.float32
        and cache.value_dtype == torch.float32
        and type(cache).gather is PagedKvCache.gather
        and _kernel() is not None
    )


def decode_attention(
    cache: PagedKvCache, layer: int, q: torch.Tensor, pages: DecodePages, spec: LayerAttention
) -> torch.Tensor:
    """q [B, Hq, D], one new token per request, attended over its pages -> [B, Hq, D]; a request
    that sees no slot gets zeros."""
    kernel = _kernel()
    assert kernel is not None, "decode_attention on a cache that reads_in_place refused"
    out: torch.Tensor = kernel(
        q.float(),
        cache.layer(layer),
        pages.table,
        pages.kv_lens,
        spec.scale if spec.scale is not None else q.shape[-1] ** -0.5,
        spec.softcap or 0.0,
        spec.sliding_window or 0,
        pages.visible,
    )
    return out.to(q.dtype)
