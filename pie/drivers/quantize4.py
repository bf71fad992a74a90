"""Linear weights kept in 4 bits on the CPU (`[model] weights = "int4"`): llama.cpp's Q4_1
blocks (32 weights along the input dimension, w = d * q + m with q in 0..15 and d, m in
float16), multiplied by the compiled kernel in pie.drivers.kernels with float32 activations.

A model converted from a GGUF file whose layers are Q4_0 or Q4_1 keeps the file's own blocks, so
the int4 model computes what the float32 model dequantized from that file computes, streaming
0.625 bytes per weight a step instead of float32's 4. Other weights are quantized here, each
group of 32 between its minimum and maximum."""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from attrs import frozen
from gguf import GGMLQuantizationType
from torch import nn

from pie.drivers.kernels import q4_ops
from pie.drivers.loader.gguf import hf_name, unpermute
from pie.drivers.loader.resolve import COMPLETE_MARKER
from pie.drivers.loader.safetensors import checkpoint_target
from pie.drivers.models.base import CausalLM
from pie.drivers.models.layers import FusedLinear, SplitOutput
from pie.drivers.quantize import replace_linears

BLOCK = 32
"""Weights per block along a layer's input dimension."""
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
_LEVELS = 15
Shard = str | int | None


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


class Int4Linear(nn.Module):
    """y = x W^T + b with W held as Q4_1 blocks: the file's own (`blocks`) or quantized here."""

    packed: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, blocks: Q4Blocks | None = None) -> None:
        super().__init__()
        if blocks is None:
            blocks = quantize_blocks(linear.weight)
        if blocks.shape != tuple(linear.weight.shape):
            raise ValueError(f"int4 blocks of {blocks.shape} for a {tuple(linear.weight.shape)}")
        self.register_buffer("packed", blocks.packed)
        self.register_buffer("scales", blocks.scales)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._matmul = q4_ops().linear  # built here, so a missing compiler stops the start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        rows = x.reshape(-1, self.in_features).float()
        out: torch.Tensor = self._matmul(rows, self.packed, self.scales)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(dtype)


class Int4FusedLinear(Int4Linear, SplitOutput):
    """A FusedLinear (stacked projections) in int4, split the same way."""

    def __init__(self, linear: FusedLinear, blocks: Q4Blocks | None = None) -> None:
        super().__init__(linear, blocks)
        self.split_sizes = list(linear.split_sizes)


def quantize_int4(
    model: CausalLM, source: Path | None = None, *, keep: Sequence[str] = ("lm_head",)
) -> int:
    """Replaces the linear layers of `model` by their int4 forms, in place, except those named
    in `keep`: the output head stays in the model's dtype, because it is usually tied to the
    embeddings (int4 there would add memory, not save it) and its error moves every logit.
    `source` is the folder the model was loaded from (a GGUF conversion's names its file) or a
    .gguf file: its Q4_0/Q4_1 tensors are used as they are. Returns how many layers it replaced."""
    gguf_path = gguf_source(source) if source is not None else None
    from_file = file_blocks(gguf_path, model) if gguf_path is not None else {}

    def int4(path: str, linear: nn.Linear) -> nn.Module:
        # A LoRA wrapper holds the layer it adapts as `.base`; the file names the layer.
        blocks = _assemble(linear, from_file.get(path.removesuffix(".base"), {}))
        if isinstance(linear, FusedLinear):
            return Int4FusedLinear(linear, blocks)
        return Int4Linear(linear, blocks)

    return replace_linears(model, keep, int4)


def gguf_source(source: Path) -> Path | None:
    """The GGUF file behind `source`: itself, or the file a converted folder was made from."""
    if source.suffix.lower() == ".gguf":
        return source
    marker = source / COMPLETE_MARKER
    if not marker.is_file():
        return None
    path = Path(marker.read_text().strip())
    return path if path.is_file() else None


def has_q4_layers(source: Path) -> bool:
    """Whether the GGUF behind `source` stores weight matrices as Q4_0/Q4_1 blocks."""
    path = gguf_source(source)
    return path is not None and any(name.endswith(".weight") for name, _, _ in q4_tensors(path))


def file_blocks(path: Path, model: CausalLM) -> dict[str, dict[Shard, Q4Blocks]]:
    """The file's Q4_0/Q4_1 linear weights as blocks, by our module name and then by shard;
    q/k rows reordered as the converter reorders them (rows only: blocks run along K)."""
    config = model.config.raw
    found: dict[str, dict[Shard, Q4Blocks]] = {}
    for gguf_name, kind, raw in q4_tensors(path):
        if not gguf_name.endswith(".weight"):
            continue
        name = hf_name(gguf_name, config["model_type"])
        target, shard = checkpoint_target(name, model)
        blocks = gguf_blocks(kind, unpermute(raw, name, config))
        found.setdefault(target.removesuffix(".weight"), {})[shard] = blocks
    return found


def q4_tensors(path: Path) -> Iterator[tuple[str, GGMLQuantizationType, np.ndarray]]:
    """A GGUF file's Q4_0/Q4_1 tensors as [rows, bytes per row] arrays over the mapped file,
    found from its tensor index alone: gguf's GGUFReader parses every metadata value first,
    which took 2.9 s for the default model's 49152-token vocabulary."""
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
        if kind in _BLOCK_BYTES:
            rows, width = math.prod(shape[1:]), shape[0] // BLOCK * _BLOCK_BYTES[kind]
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
    """A GGUF tensor's bytes [N, bytes per row] as blocks: Q4_1 (2 bytes d, 2 bytes m, 16 bytes
    of nibbles) or Q4_0 (2 bytes d, 16 of nibbles, w = d * (q - 8): m = -8 d, exact in float16
    as -8 is a power of two)."""
    size = _BLOCK_BYTES[kind]
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


def _assemble(layer: nn.Linear, pieces: dict[Shard, Q4Blocks]) -> Q4Blocks:
    """The layer's blocks: the file's for each shard it has, quantized here for the rest."""
    shards = layer.shards if isinstance(layer, FusedLinear) else {None: (0, layer.out_features)}
    parts = []
    for shard, (offset, size) in sorted(shards.items(), key=lambda item: item[1][0]):
        part = pieces.get(shard)
        if part is None:
            part = quantize_blocks(layer.weight[offset : offset + size])
        if part.shape != (size, layer.in_features):
            raise ValueError(f"GGUF blocks of {part.shape} for rows {size} x {layer.in_features}")
        parts.append(part)
    # numpy: torch.cat of uint8 took milliseconds per layer here, a plain copy microseconds.
    packed = np.concatenate([p.packed.numpy() for p in parts])
    scales = np.concatenate([p.scales.numpy() for p in parts])
    return Q4Blocks(torch.from_numpy(packed), torch.from_numpy(scales))
