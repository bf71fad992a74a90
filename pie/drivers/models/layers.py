"""Building blocks shared by the decoder architectures: RMSNorm, rotary embedding,
fused projections that the loader fills shard by shard, and the gated SiLU MLP."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Rope = tuple[torch.Tensor, torch.Tensor]
"""cos and sin for a batch's positions, each [T, head_dim // 2] float32."""

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class LayerKernels:
    """The small operations of a decoder layer (norms, the residual add, rotary embedding) as
    plain torch ops. A driver with fused kernels for them hands the model its own subclass
    (CausalLM.use_kernels): on a GPU each torch op is a kernel launch, and a layer of them costs
    more than its matrix products at small batches."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        # Scaling after the cast back matches the reference models bit for bit in bf16.
        return weight * x.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rope(self, positions: torch.Tensor, rotary: RotaryEmbedding) -> Any:
        """What `rotate` needs for a batch's positions, looked up once for every layer."""
        return rotary(positions)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated (the "rotate_half" layout)."""
        return apply_rotary(q, rope), apply_rotary(k, rope)


TORCH_KERNELS = LayerKernels()


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32."""

    kernels: LayerKernels = TORCH_KERNELS

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm of x + residual, and x + residual (the next residual)."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 for the given rope scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: slow down long wavelengths by `factor`, keep short ones, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the model's limit, looked up per batch."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Tables stay float32 whatever the model dtype; they are cast per use, like the references.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @classmethod
    def for_config(cls, config: Any) -> RotaryEmbedding:
        """The tables a ModelConfig's head_dim, positions, theta and scaling describe."""
        return cls(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )

    def forward(self, positions: torch.Tensor) -> Rope:
        return self.cos[positions], self.sin[positions]

    def cos_sin_table(self) -> torch.Tensor:
        """[max_positions, head_dim] float32: cos in the first half, sin in the second, made
        once and kept with the model (a captured CUDA graph reads it on every replay)."""
        table: torch.Tensor | None = getattr(self, "_cos_sin", None)
        if table is None:
            table = torch.cat((self.cos, self.sin), dim=-1).float().contiguous()
            self._cos_sin = table
        return table


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in the "rotate_half" layout (first half pairs with second)."""
    cos, sin = (t.unsqueeze(-2).to(x.dtype) for t in rope)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SplitOutput(nn.Module):
    """A projection whose output stacks several (q/k/v, gate/up): `forward_split` cuts it back
    into them. Every form of a fused projection (float, int8, int4, LoRA-wrapped) has one."""

    split_sizes: list[int]

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # split_with_sizes itself: Tensor.split's Python wrapper costs more than the split.
        return tuple(torch.split_with_sizes(self(x), self.split_sizes, dim=-1))


class FusedLinear(nn.Linear, SplitOutput):
    """Several projections of the same input stacked along the output dimension.

    `shards` maps a checkpoint shard id (e.g. "q", or 0 for gate) to its (offset, size) rows,
    so the loader can copy each separate checkpoint weight into its slice.
    """

    def __init__(
        self, in_features: int, shards: Sequence[tuple[str | int, int]], bias: bool
    ) -> None:
        super().__init__(in_features, sum(size for _, size in shards), bias=bias)
        self.shards: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards:
            self.shards[shard_id] = (offset, size)
            offset += size
        self.split_sizes = [size for _, size in shards]

    def load_shard(self, param: nn.Parameter, weight: torch.Tensor, shard_id: str | int) -> None:
        offset, size = self.shards[shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != weight.shape:
            raise ValueError(
                f"shard {shard_id!r}: expected {tuple(target.shape)}, got {tuple(weight.shape)}"
            )
        target.copy_(weight)


def qkv_projection(
    hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool
) -> FusedLinear:
    kv_size = num_kv_heads * head_dim
    return FusedLinear(
        hidden_size, [("q", num_heads * head_dim), ("k", kv_size), ("v", kv_size)], bias
    )


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(
            hidden_size, [(0, intermediate_size), (1, intermediate_size)], bias=False
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(F.silu(gate) * up)
