"""Weights in blocks of 32 along a layer's input dimension, in two of llama.cpp's formats, and
reading them straight from a GGUF file: Q4_1 (w = d * q + m, q in 0..15; Q4_0 is read as Q4_1
with m = -8 d) and Q8_0 (w = d * q, q an int8). The compiled kernels in pie.drivers.kernels
multiply float32 activations by either."""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from attrs import frozen
from gguf import GGMLQuantizationType

BLOCK = 32
"""Weights per block along a layer's input dimension."""
BLOCK_BYTES = {
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
    GGMLQuantizationType.Q8_0: 34,
}
"""Bytes of one block in the file: float16 scale(s), then the packed levels."""
Q4_KINDS = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
_LEVELS = 15


@frozen
class Q4Blocks:
    """A weight [N, K] as Q4_1 blocks: `packed` uint8 [N, K/2] (in each block's 16 bytes the low
    nibbles are weights 0..15 and the high nibbles 16..31) and `scales` float16 [N, K/32, 2]
    (each block's d, then m)."""

    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the blocks stand for."""
        rows, inputs = self.shape
        nibbles = self.packed.reshape(rows, inputs // BLOCK, BLOCK // 2)
        levels = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()
        d, m = self.scales.float().unbind(-1)
        return (levels * d[..., None] + m[..., None]).reshape(rows, inputs)


def quantize_blocks(weight: torch.Tensor) -> Q4Blocks:
    """Q4_1 blocks for a float weight [N, K]: each group of 32 spans its minimum to maximum."""
    rows, inputs = weight.shape
    if inputs % BLOCK:
        raise ValueError(f"int4 weights need in_features divisible by {BLOCK}, not {inputs}")
    groups = weight.detach().float().reshape(rows, inputs // BLOCK, BLOCK)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = torch.stack([(high - low) / _LEVELS, low], dim=-1).half()
    if not torch.isfinite(scales).all():
        raise ValueError("int4 weights: a block's range does not fit float16")
    # Levels from the float16-rounded d and m, so that rounding them costs no extra error.
    d, m = scales.float().unbind(-1)
    levels = ((groups - m[..., None]) / d.clamp(min=1e-30)[..., None]).round_().clamp_(0, _LEVELS)
    levels = levels.to(torch.uint8)
    packed = levels[..., : BLOCK // 2] | (levels[..., BLOCK // 2 :] << 4)
    return Q4Blocks(packed.reshape(rows, inputs // 2).contiguous(), scales.contiguous())


@frozen
class Q8Blocks:
    """A weight [N, K] as Q8_0 blocks: `packed` int8 [N, K] and `scales` float16 [N, K/32, 1]
    (each block's d)."""

    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the blocks stand for."""
        rows, inputs = self.shape
        levels = self.packed.reshape(rows, inputs // BLOCK, BLOCK).float()
        return (levels * self.scales.float()).reshape(rows, inputs)


def quantize_blocks8(weight: torch.Tensor) -> Q8Blocks:
    """Q8_0 blocks for a float weight [N, K] as llama.cpp makes them: each group of 32 scaled by
    its absmax / 127 (the levels from that float32 scale, halves rounded away from zero)."""
    rows, inputs = weight.shape
    if inputs % BLOCK:
        raise ValueError(f"Q8_0 weights need in_features divisible by {BLOCK}, not {inputs}")
    groups = weight.detach().float().reshape(rows, inputs // BLOCK, BLOCK)
    d = groups.abs().amax(-1, keepdim=True) / 127.0
    scales = d.half()
    if not torch.isfinite(scales).all():
        raise ValueError("Q8_0 weights: a block's range does not fit float16")
    inverse = torch.where(d == 0, 0.0, 1.0 / d)
    scaled = groups * inverse
    levels = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    return Q8Blocks(levels.reshape(rows, inputs).contiguous(), scales.contiguous())


def block_tensors(
    path: Path, kinds: tuple[GGMLQuantizationType, ...] = tuple(BLOCK_BYTES)
) -> Iterator[tuple[str, GGMLQuantizationType, np.ndarray]]:
    """A GGUF file's tensors of the block `kinds` as [rows, bytes per row] arrays over the
    mapped file, found from its tensor index alone: gguf's GGUFReader parses every metadata
    value first, which took 2.9 s for the default model's 49152-token vocabulary."""
    with path.open("rb") as file:
        data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    magic, version, tensors, fields = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a GGUF file of version 2 or 3")
    offset, alignment = 24, 32
    for _ in range(fields):
        key, offset = _string(data, offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, offset + 4)
        offset = _skip_value(data, offset + 4, kind)
    index = []
    for _ in range(tensors):
        name, offset = _string(data, offset)
        (dims,) = struct.unpack_from("<I", data, offset)
        shape = struct.unpack_from(f"<{dims}Q", data, offset + 4)
        kind, start = struct.unpack_from("<IQ", data, offset + 4 + 8 * dims)
        offset += 16 + 8 * dims
        index.append((name, shape, kind, start))
    base = -(-offset // alignment) * alignment
    for name, shape, kind, start in index:
        if kind in kinds:
            rows, width = math.prod(shape[1:]), shape[0] // BLOCK * BLOCK_BYTES[kind]
            raw = np.frombuffer(data, np.uint8, count=rows * width, offset=base + start)
            yield name, GGMLQuantizationType(kind), raw.reshape(rows, width)


_STRING, _ARRAY = 8, 9
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value types -> bytes (u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64)."""


def _string(data: mmap.mmap, offset: int) -> tuple[str, int]:
    (size,) = struct.unpack_from("<Q", data, offset)
    end = offset + 8 + size
    return data[offset + 8 : end].decode(), end


def _skip_value(data: mmap.mmap, offset: int, kind: int) -> int:
    """The offset past one metadata value of type `kind` that starts at `offset`."""
    if kind == _STRING:
        (size,) = struct.unpack_from("<Q", data, offset)
        return offset + 8 + size
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if item in _SCALAR_BYTES:
            return offset + count * _SCALAR_BYTES[item]
        for _ in range(count):
            offset = _skip_value(data, offset, item)
        return offset
    return offset + _SCALAR_BYTES[kind]


def gguf_blocks(kind: GGMLQuantizationType, raw: np.ndarray) -> Q4Blocks:
    """A GGUF Q4_0/Q4_1 tensor's bytes [N, bytes per row] as blocks: Q4_1 (2 bytes d, 2 bytes
    m, 16 bytes of nibbles) or Q4_0 (2 bytes d, 16 of nibbles, w = d * (q - 8): m = -8 d, exact
    in float16 as -8 is a power of two)."""
    size = BLOCK_BYTES[kind]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)
    if kind == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)
    else:
        m = d * np.float16(-8)
    scales = np.concatenate([d, m], axis=-1)
    packed = blocks[..., size - BLOCK // 2 :].reshape(rows, -1)
    return Q4Blocks(torch.from_numpy(packed.copy()), torch.from_numpy(scales))


def gguf_blocks8(raw: np.ndarray) -> Q8Blocks:
    """A GGUF Q8_0 tensor's bytes [N, bytes per row] (each block: 2 bytes d, 32 int8) as blocks."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, BLOCK_BYTES[GGMLQuantizationType.Q8_0])
    scales = blocks[..., 0:2].copy().view(np.float16)
    packed = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return Q8Blocks(torch.from_numpy(packed), torch.from_numpy(scales))
