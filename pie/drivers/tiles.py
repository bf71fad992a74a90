"""Block weights in 16-row tiles, the layout the int8-activation kernel reads
(kernels/int8_dot.h): block b of 16 consecutive rows stored together, 4 bytes of each row side
by side, the tile's scales beside them, and Q8_0 levels offset by 128. A layer's tiles replace
its blocks (same bytes, another order), so tiling costs no memory."""

from __future__ import annotations

import torch
from attrs import frozen

from pie.drivers.gguf_blocks import BLOCK, Q4Blocks, Q8Blocks

TILE = 16
ACTIVATIONS = ("float32", "int8")


@frozen
class Tiles:
    """A weight [N, K] in tiles: `packed` uint8 [N/16, K/32 * 16 * bytes per block] and `scales`
    float16 [N/16, K/32, scales per block, 16]."""

    packed: torch.Tensor
    scales: torch.Tensor
    q8: bool
    """Q8_0 blocks (levels stored offset by 128); Q4_1 otherwise."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0] * TILE, self.scales.shape[1] * BLOCK


def tiles_fit(blocks: Q4Blocks | Q8Blocks) -> bool:
    return blocks.shape[0] % TILE == 0


def tile(blocks: Q4Blocks | Q8Blocks) -> Tiles:
    """The tiled form of `blocks` (whose row count is a multiple of 16)."""
    rows, _ = blocks.shape
    if rows % TILE:
        raise ValueError(f"tiles hold 16 rows each; the weight has {rows}")
    per_row = blocks.scales.shape[1]
    q8 = isinstance(blocks, Q8Blocks)
    packed = blocks.packed.view(torch.uint8)
    if q8:
        packed = packed ^ 0x80
    groups = packed.shape[1] // per_row // 4
    packed = packed.reshape(rows // TILE, TILE, per_row, groups, 4).permute(0, 2, 3, 1, 4)
    scales = blocks.scales.reshape(rows // TILE, TILE, per_row, -1).permute(0, 2, 3, 1)
    return Tiles(packed.reshape(rows // TILE, -1).contiguous(), scales.contiguous(), q8)


def untile(tiles: Tiles) -> Q4Blocks | Q8Blocks:
    """The blocks `tiles` was made from."""
    tiled_rows, per_row = tiles.scales.shape[:2]
    packed = tiles.packed.reshape(tiled_rows, per_row, -1, TILE, 4).permute(0, 3, 1, 2, 4)
    packed = packed.reshape(tiled_rows * TILE, -1).contiguous()
    scales = tiles.scales.permute(0, 3, 1, 2).reshape(tiled_rows * TILE, per_row, -1).contiguous()
    if tiles.q8:
        return Q8Blocks((packed ^ 0x80).view(torch.int8), scales)
    return Q4Blocks(packed, scales)


def int8_activations(setting: str) -> bool:
    """Whether `[model] activations` asks for int8 rows (and so tiled weights); "int8" on a CPU
    whose kernel build lacks AVX-512 VNNI is refused."""
    from pie.drivers.kernels import q4_ops

    if setting not in ACTIVATIONS:
        raise ValueError(f"[model] activations must be one of {ACTIVATIONS}, not {setting!r}")
    if setting == "int8" and not q4_ops().int8_dot():
        raise ValueError(
            "[model] activations = 'int8' needs AVX-512 VNNI, which this CPU's kernel build "
            f"({q4_ops().isa()}) lacks: use 'float32'"
        )
    return setting == "int8"
