"""The vision tower of Qwen2-VL and Qwen2.5-VL: patch rows to merged soft-token embeddings, with
2D rotary positions and attention kept within each frame (Qwen2.5-VL: within windows, except in
its full-attention blocks), several images and videos in one call."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from attrs import frozen
from torch import nn

from pie.drivers.models.layers import FusedLinear, RMSNorm, Rope, apply_rotary

Grid = tuple[int, int, int]
"""(t, h, w) in patches."""

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
_NORM_EPS = 1e-6


@frozen(kw_only=True)
class VisionConfig:
    """The tower's shape, from config.json's `vision_config`."""

    depth: int
    embed_dim: int
    out_dim: int
    """The language model's hidden size: the merger's output."""
    num_heads: int
    mlp_dim: int
    act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    rope_theta: float
    gated: bool = False
    """Qwen2.5-VL: RMSNorm and a gated MLP with biases, instead of LayerNorm and fc1/fc2."""
    window: int | None = None
    """Qwen2.5-VL: the side of an attention window in merged blocks (None: frames only)."""
    full_attention_blocks: frozenset[int] = frozenset()
    """Blocks that attend over whole frames although the tower has windows."""

    @classmethod
    def qwen2_vl(cls, raw: Mapping[str, Any]) -> VisionConfig:
        """Qwen2-VL's keys, with its config class's defaults."""
        embed = raw.get("embed_dim", 1280)
        return cls(
            depth=raw.get("depth", 32),
            embed_dim=embed,
            out_dim=raw.get("hidden_size", 3584),
            num_heads=raw.get("num_heads", 16),
            mlp_dim=int(embed * raw.get("mlp_ratio", 4)),
            act=_activation(raw.get("hidden_act", "quick_gelu")),
            **_common(raw),
        )

    @classmethod
    def qwen2_5_vl(cls, raw: Mapping[str, Any]) -> VisionConfig:
        """Qwen2.5-VL's keys, with its config class's defaults: `hidden_size` is the tower's
        width there and `out_hidden_size` the merger's output."""
        common = _common(raw)
        window = raw.get("window_size", 112) // common["merge_size"] // common["patch_size"]
        return cls(
            depth=raw.get("depth", 32),
            embed_dim=raw.get("hidden_size", 3584),
            out_dim=raw.get("out_hidden_size", 3584),
            num_heads=raw.get("num_heads", 16),
            mlp_dim=raw.get("intermediate_size", 3420),
            act=_activation(raw.get("hidden_act", "silu")),
            gated=True,
            window=window,
            full_attention_blocks=frozenset(raw.get("fullatt_block_indexes", (7, 15, 23, 31))),
            **common,
        )


def _common(raw: Mapping[str, Any]) -> dict[str, Any]:
    rope = raw.get("rope_parameters") or {}
    return dict(
        in_channels=raw.get("in_channels", raw.get("in_chans", 3)),
        patch_size=raw.get("patch_size", 14),
        temporal_patch_size=raw.get("temporal_patch_size", 2),
        merge_size=raw.get("spatial_merge_size", 2),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"qwen2_vl and qwen2_5_vl vision towers: unsupported hidden_act {name!r}; "
            f"supported: {sorted(ACTIVATIONS)}"
        )
    return name


class Segments:
    """Runs of consecutive rows that attend only among themselves (frames or windows); runs of
    one length are batched into one attention call."""

    def __init__(self, lengths: Sequence[int], device: torch.device) -> None:
        starts: dict[int, list[int]] = {}
        at = 0
        for length in lengths:
            starts.setdefault(length, []).append(at)
            at += length
        # For each length L: [runs, L] row indices.
        self.groups = [
            torch.tensor(run_starts, device=device)[:, None] + torch.arange(length, device=device)
            for length, run_starts in starts.items()
            if length
        ]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [N, heads, head_dim] -> bidirectional attention within each run."""
        out = torch.empty_like(q)
        for rows in self.groups:
            # [runs, heads, L, head_dim]
            qs, ks, vs = (x[rows].transpose(1, 2) for x in (q, k, v))
            out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return out


def frame_lengths(grids: Sequence[Grid]) -> list[int]:
    """Patches per frame of every item, in row order."""
    return [h * w for t, h, w in grids for _ in range(t)]


def patch_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """[N, 2] (row, column) of every patch in the tower's row order: frames, then merged blocks
    row by row, then the patches of a block row by row."""
    rows = []
    for t, h, w in grids:
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocked = (h // merge, merge, w // merge, merge)
        yx = torch.stack([ys.reshape(blocked), xs.reshape(blocked)], dim=-1).transpose(1, 2)
        rows.append(yx.reshape(-1, 2).repeat(t, 1))
    return torch.cat(rows)


def window_order(grids: Sequence[Grid], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged blocks regrouped so that each window's blocks are consecutive (per frame:
    windows row by row, blocks row by row inside one), and each window's length in patches."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    offset = 0
    for t, h, w in grids:
        bh, bw = h // merge, w // merge
        blocks = torch.arange(t * bh * bw).view(t, bh, bw) + offset
        for frame in blocks:
            for y in range(0, bh, window):
                for x in range(0, bw, window):
                    tile = frame[y : y + window, x : x + window].reshape(-1)
                    order.append(tile)
                    lengths.append(tile.numel() * merge * merge)
        offset += t * bh * bw
    return torch.cat(order), lengths


class PatchEmbed(nn.Module):
    """Patch rows to embeddings. A Conv3d whose stride is its kernel is a matmul over the flat
    rows; the module only holds the checkpoint's [out, channels, time, height, width] weight."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        c = config
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.embed_dim, kernel, kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.device, weight.dtype), weight.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)

    def forward(self, x: torch.Tensor, rope: Rope, segments: Segments) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        # Rotated in float32 whatever the tower's dtype, as the reference does.
        q, k = (apply_rotary(y.float(), rope).to(y.dtype) for y in (q, k))
        return self.proj(segments.attend(q, k, v).flatten(1))


class VisionMLP(nn.Module):
    """fc2(act(fc1(x))), biases on both."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.mlp_dim)
        self.fc2 = nn.Linear(config.mlp_dim, config.embed_dim)
        self.act = ACTIVATIONS[config.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """down(act(gate(x)) * up(x)), biases on all three, gate and up fused."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        size = config.mlp_dim
        self.gate_up_proj = FusedLinear(config.embed_dim, [(0, size), (1, size)], bias=True)
        self.down_proj = nn.Linear(size, config.embed_dim)
        self.act = ACTIVATIONS[config.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(self.act(gate) * up)


def _norm(config: VisionConfig, size: int) -> nn.Module:
    return RMSNorm(size, _NORM_EPS) if config.gated else nn.LayerNorm(size, eps=_NORM_EPS)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config, config.embed_dim)
        self.norm2 = _norm(config, config.embed_dim)
        self.attn = VisionAttention(config)
        self.mlp = GatedVisionMLP(config) if config.gated else VisionMLP(config)

    def forward(self, x: torch.Tensor, rope: Rope, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge x merge block of patch embeddings, normed and concatenated, to one token."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        width = config.embed_dim * config.merge_size**2
        self.ln_q = _norm(config, config.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, config.out_dim)
        )
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTower(nn.Module):
    """Patch rows of several items at once to their soft-token embeddings."""

    inv_freq: torch.Tensor

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)
        # Each of height and width takes a quarter of a head's dimensions.
        quarter = torch.arange(0, c.embed_dim // c.num_heads // 2, 2, dtype=torch.float32)
        inv_freq = 1.0 / c.rope_theta ** (quarter / (c.embed_dim // c.num_heads // 2))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixels [patches, in_channels * temporal_patch_size * patch_size**2], the items'
        rows one after another -> [patches / merge**2, out_dim]."""
        x = self.patch_embed(pixels)
        rope = self.rope(patch_positions(grids, self.config.merge_size).to(x.device))
        frames = Segments(frame_lengths(grids), x.device)
        if self.config.window is None:
            return self.merger(self.run_blocks(x, rope, frames, frames))
        return self.windowed(x, rope, grids, frames)

    def windowed(
        self, x: torch.Tensor, rope: Rope, grids: Sequence[Grid], frames: Segments
    ) -> torch.Tensor:
        """The blocks over rows regrouped by window (which keeps each frame's rows together),
        and the merged tokens put back in their own order."""
        assert self.config.window is not None
        order, lengths = window_order(grids, self.config.merge_size, self.config.window)
        order = order.to(x.device)
        unit = self.config.merge_size**2
        x = _take_blocks(x, order, unit)
        rope = (_take_blocks(rope[0], order, unit), _take_blocks(rope[1], order, unit))
        merged = self.merger(self.run_blocks(x, rope, frames, Segments(lengths, x.device)))
        return merged[torch.argsort(order)]

    def run_blocks(
        self, x: torch.Tensor, rope: Rope, frames: Segments, windows: Segments
    ) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            full = self.config.window is None or i in self.config.full_attention_blocks
            x = block(x, rope, frames if full else windows)
        return x

    def rope(self, positions: torch.Tensor) -> Rope:
        """cos, sin [N, head_dim // 2]: the row's angles, then the column's."""
        angles = (positions[:, :, None].float() * self.inv_freq).flatten(1)
        return angles.cos(), angles.sin()


def _take_blocks(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """x's rows taken block by block (`unit` rows a block) in `order`."""
    return x.view(-1, unit, x.shape[-1])[order].view(-1, x.shape[-1])
