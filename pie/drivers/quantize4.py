"""Linear weights kept in 4 bits on the CPU (`[model] weights = "int4"`): llama.cpp's Q4_1
blocks (32 weights along the input dimension, w = d * q + m with q in 0..15 and d, m in
float16), multiplied by the compiled kernel in pie.drivers.kernels with float32 activations,
or, with the weights in 16-row tiles (`[model] activations = "int8"`, tiles.py), with every row
of x in int8 blocks, the way llama.cpp multiplies them.

A model converted from a GGUF file whose layers are Q4_0 or Q4_1 keeps the file's own blocks, so
the int4 model with float32 activations computes what the float32 model dequantized from that
file computes, streaming
0.625 bytes per weight a step instead of float32's 4. Other weights are quantized here, each
group of 32 between its minimum and maximum."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from attrs import frozen
from torch import nn

from pie.drivers.gguf_blocks import (
    Q4_KINDS,
    Q4Blocks,
    Q8Blocks,
    block_tensors,
    gguf_blocks,
    quantize_blocks,
)
from pie.drivers.kernels import q4_ops
from pie.drivers.loader.gguf import hf_name, unpermute
from pie.drivers.loader.resolve import COMPLETE_MARKER
from pie.drivers.loader.safetensors import checkpoint_target
from pie.drivers.models.base import CausalLM
from pie.drivers.models.layers import FusedLinear, SplitOutput
from pie.drivers.q8_head import embeddings_name, file_tables, head_table, quantize_head
from pie.drivers.quantize import replace_linears
from pie.drivers.tiles import tile, tiles_fit

Shard = str | int | None


class Int4Linear(nn.Module):
    """y = x W^T + b with W held as Q4_1 blocks: the file's own (`blocks`) or quantized here.
    `tiled`: in 16-row tiles (tiles.py), whose inputs multiply as int8 blocks."""

    packed: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, linear: nn.Linear, blocks: Q4Blocks | None = None, *, tiled: bool = False
    ) -> None:
        super().__init__()
        if blocks is None:
            blocks = quantize_blocks(linear.weight)
        if blocks.shape != tuple(linear.weight.shape):
            raise ValueError(f"int4 blocks of {blocks.shape} for a {tuple(linear.weight.shape)}")
        ops = q4_ops()  # built here, so a missing compiler stops the start
        self.tiled = tiled and tiles_fit(blocks)
        held = tile(blocks) if self.tiled else blocks
        self.register_buffer("packed", held.packed)
        self.register_buffer("scales", held.scales)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._matmul = (ops.linear_tiled if self.tiled else ops.linear).default
        self._hold()

    def _hold(self) -> None:
        # Plain attributes for the buffers: a decode step calls 120 of these layers, and
        # nn.Module's attribute lookup for buffers cost about a third of each call's overhead.
        self._weights = (self.packed, self.scales)
        self._bias = self.bias

    def _apply(self, fn: Any, recurse: bool = True) -> Int4Linear:
        super()._apply(fn, recurse)
        self._hold()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = x.dim() == 2 and x.dtype == torch.float32
        rows = x if plain else x.reshape(-1, self.in_features).float()
        out: torch.Tensor = self._matmul(rows, *self._weights)
        if self._bias is not None:
            out.add_(self._bias)
        if plain:
            return out
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class Int4FusedLinear(Int4Linear, SplitOutput):
    """A FusedLinear (stacked projections) in int4, split the same way."""

    def __init__(
        self, linear: FusedLinear, blocks: Q4Blocks | None = None, *, tiled: bool = False
    ) -> None:
        super().__init__(linear, blocks, tiled=tiled)
        self.split_sizes = list(linear.split_sizes)


@frozen
class FileWeights:
    """What a GGUF file supplies for a model's int4 form, read before the float weights are:
    its Q4_0/Q4_1 linear layers as blocks (by module path, then shard) and its Q8_0 embedding
    and output tables (by module name, `embed_tokens` / `lm_head`)."""

    layers: dict[str, dict[Shard, Q4Blocks]]
    tables: dict[str, Q8Blocks]

    @classmethod
    def read(cls, source: Path | None, model: CausalLM) -> FileWeights:
        """The blocks of the GGUF behind `source` (none when there is no such file)."""
        path = gguf_source(source) if source is not None else None
        if path is None:
            return cls({}, {})
        return cls(file_blocks(path, model), file_tables(path, model))

    def skip(self, model: CausalLM) -> set[tuple[str, Shard]]:
        """The (parameter, shard) pairs the float checkpoint need not fill: every shard the file
        has of a layer, and the embeddings when a tied head will take the file's table."""
        found = {
            (f"{path}.weight", shard) for path, shards in self.layers.items() for shard in shards
        }
        if head_table(model, self.tables) is not None:
            tied = model.config.tie_word_embeddings
            found.add((f"{embeddings_name(model)}.weight" if tied else "lm_head.weight", None))
        return found


def to_int4(model: CausalLM, weights: FileWeights, *, tiled: bool = False) -> int:
    """The int4 form of `model`, in place: its decoder's linear layers in Q4_1 blocks and its
    head (with tied embeddings) in Q8_0 blocks, the file's own where `weights` has them, in
    tiles when `tiled` (inputs then multiply as int8 blocks). Returns how many modules it
    replaced."""
    layers = quantize_int4(model, weights=weights, tiled=tiled)
    return layers + quantize_head(model, weights.tables, tiled=tiled)


def quantize_int4(
    model: CausalLM,
    source: Path | None = None,
    *,
    keep: Sequence[str] = ("lm_head",),
    weights: FileWeights | None = None,
    tiled: bool = False,
) -> int:
    """Replaces the linear layers of `model` by their int4 forms, in place, except those named
    in `keep` (the output head: see q8_head.py). `source` is the folder the model was loaded
    from (a GGUF conversion's names its file) or a .gguf file, or `weights` what was read from
    it: its Q4_0/Q4_1 tensors are used as they are. Returns how many layers it replaced."""
    if weights is None:
        weights = FileWeights.read(source, model)
    from_file = weights.layers

    def int4(path: str, linear: nn.Linear) -> nn.Module:
        # A LoRA wrapper holds the layer it adapts as `.base`; the file names the layer.
        blocks = _assemble(linear, from_file.get(path.removesuffix(".base"), {}))
        if isinstance(linear, FusedLinear):
            return Int4FusedLinear(linear, blocks, tiled=tiled)
        return Int4Linear(linear, blocks, tiled=tiled)

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
    return path is not None and any(
        name.endswith(".weight") for name, _, _ in block_tensors(path, Q4_KINDS)
    )


def file_blocks(path: Path, model: CausalLM) -> dict[str, dict[Shard, Q4Blocks]]:
    """The file's Q4_0/Q4_1 linear weights as blocks, by our module name and then by shard;
    q/k rows reordered as the converter reorders them (rows only: blocks run along K)."""
    config = model.config.raw
    found: dict[str, dict[Shard, Q4Blocks]] = {}
    for gguf_name, kind, raw in block_tensors(path, Q4_KINDS):
        if not gguf_name.endswith(".weight"):
            continue
        name = hf_name(gguf_name, config["model_type"])
        target, shard = checkpoint_target(name, model)
        blocks = gguf_blocks(kind, unpermute(raw, name, config))
        found.setdefault(target.removesuffix(".weight"), {})[shard] = blocks
    return found


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
