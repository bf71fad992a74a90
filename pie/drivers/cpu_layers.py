"""A decoder layer's small operations (norms, the residual add, rotary embedding) on pie's
compiled CPU kernels (kernels/layer_ops.cpp): one call each, where the torch versions spend
more time dispatching and allocating their handful of ops than computing at batch 1."""

from __future__ import annotations

import sys
from typing import Any

import torch

from pie.drivers.kernels import KernelBuildError, kernel_ops
from pie.drivers.models.layers import TORCH_KERNELS, LayerKernels


def _rows(x: torch.Tensor) -> bool:
    """x is what the kernels read: float32 [T, D] or [T, heads, D] on the CPU, each row dense."""
    return x.dtype == torch.float32 and x.is_cpu and x.dim() in (2, 3) and x.stride(-1) == 1


def _table(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous()


class CpuLayerKernels(LayerKernels):
    """`ops`: the "layer" kernel library of one build variant. float32 CPU tensors outside
    autograd go to it; the residual add and rotary embedding then work in place, as the fused
    GPU kernels do (callers use the returned tensors either way). Another dtype, a pass that
    records gradients or a row that is not dense takes the torch version; shapes that do not
    fit together are refused by both."""

    def __init__(self, ops: Any) -> None:
        # The overloads themselves: calling the packet costs a lookup per call.
        self._rms_norm = ops.rms_norm.default
        self._add_rms_norm = ops.add_rms_norm.default
        self._rotate = ops.rotate.default

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if torch.is_grad_enabled() or not (_rows(x) and weight.dtype == torch.float32):
            return super().rms_norm(x, weight, eps)
        out: torch.Tensor = self._rms_norm(x, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled() or not (
            _rows(x) and _rows(residual) and weight.dtype == torch.float32
        ):
            return super().add_rms_norm(x, residual, weight, eps)
        self._add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        if torch.is_grad_enabled() or not (
            _rows(q) and _rows(k) and q.dim() == 3 and _table(cos) and _table(sin)
        ):
            return super().rotate(q, k, rope)
        self._rotate(q, k, cos, sin)
        return q, k


def cpu_layer_kernels() -> LayerKernels:
    """The compiled kernels when they build here, else the torch ops (saying why on stderr)."""
    try:
        return CpuLayerKernels(kernel_ops("layer"))
    except KernelBuildError as e:
        print(f"pie: torch layer ops: the fused CPU kernels are unavailable ({e})", file=sys.stderr)
        return TORCH_KERNELS
