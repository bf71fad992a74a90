"""A decoder layer's small operations on flashinfer's fused kernels: one kernel per norm (q/k
norms over all heads at once), the residual add fused into the norm after it, and rotary
embedding of q and k in place from one cos/sin table. On a GPU the torch versions cost a
launch per elementwise op, about 60 a layer, which outweighs the matrix products of a small
model at small batches."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from pie.drivers.models.layers import TORCH_KERNELS, LayerKernels, RotaryEmbedding


class FlashinferLayerKernels(LayerKernels):
    def __init__(self, flashinfer: ModuleType | Any) -> None:
        self.norm = flashinfer.norm
        self.apply_rope = flashinfer.rope.apply_rope_with_cos_sin_cache_inplace

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 3:  # [T, heads, head_dim]: per-head norms
            return self.norm.rmsnorm(x, weight, eps, enable_pdl=False)
        return self.norm.rmsnorm(x.view(-1, x.shape[-1]), weight, eps, enable_pdl=False).view(
            x.shape
        )

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In place: residual += x, then x = rms_norm(residual).
        self.norm.fused_add_rmsnorm(x, residual, weight, eps, enable_pdl=False)
        return x, residual

    def rope(self, positions: torch.Tensor, rotary: RotaryEmbedding) -> Any:
        return positions, rotary.cos_sin_table()

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions, table = rope
        head_dim = q.shape[-1]
        self.apply_rope(
            positions, q.view(q.shape[0], -1), k.view(k.shape[0], -1), head_dim, table, True
        )
        return q, k


def layer_kernels_for(kernels: ModuleType | Any) -> LayerKernels:
    """flashinfer's fused layer kernels when `kernels` has them, else the torch ops."""
    if hasattr(kernels, "norm") and hasattr(kernels, "rope"):
        return FlashinferLayerKernels(kernels)
    return TORCH_KERNELS
