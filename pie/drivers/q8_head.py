"""The output head and the token embeddings kept as Q8_0 blocks (`[model] weights = "int4"`):
int8 levels with a float16 scale per 32 weights, a quarter of float32's bytes. The head reads
the whole table every step, which made it a quarter of a float32 head's batch-1 decode time;
tied to the embeddings, one table serves both, and an embedding lookup dequantizes only the
rows it needs. A GGUF file's own Q8_0 table is used as it is, so the head computes what the
float32 model dequantized from that file computes; otherwise the model's weight is quantized."""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pie.drivers.gguf_blocks import Q8Blocks, block_tensors, gguf_blocks8, quantize_blocks8
from pie.drivers.kernels import q4_ops
from pie.drivers.loader.gguf import hf_name
from pie.drivers.models.base import CausalLM
from pie.drivers.tiles import Tiles, tile, tiles_fit


class Q8Linear(nn.Module):
    """y = x W^T with W as Q8_0 blocks, or their tiles (no bias: an output head has none)."""

    packed: torch.Tensor
    scales: torch.Tensor

    def __init__(self, blocks: Q8Blocks | Tiles) -> None:
        super().__init__()
        self.register_buffer("packed", blocks.packed)
        self.register_buffer("scales", blocks.scales)
        self.out_features, self.in_features = blocks.shape
        self.tiled = isinstance(blocks, Tiles)
        self._matmul = q4_ops().linear8_tiled if self.tiled else q4_ops().linear8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        out: torch.Tensor = self._matmul(rows, self.packed, self.scales)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class Q8Embedding(nn.Module):
    """Token embeddings looked up in Q8_0 blocks, returned in `dtype`."""

    packed: torch.Tensor
    scales: torch.Tensor

    def __init__(self, blocks: Q8Blocks | Tiles, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("packed", blocks.packed)
        self.register_buffer("scales", blocks.scales)
        self.num_embeddings, self.embedding_dim = blocks.shape
        self.dtype = dtype
        self._rows = q4_ops().rows8_tiled if isinstance(blocks, Tiles) else q4_ops().rows8

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._rows(self.packed, self.scales, ids.reshape(-1))
        return out.reshape(*ids.shape, self.embedding_dim).to(self.dtype)


def quantize_head(
    model: CausalLM, tables: dict[str, Q8Blocks] | None = None, *, tiled: bool = False
) -> int:
    """Puts the output head `lm_head`, and the embeddings `embed_tokens` when the head is tied
    to them, in Q8_0 blocks: a GGUF file's own from `tables` (see `file_tables`) when it has
    them, else quantized here; in tiles when `tiled` (and the rows fit). Returns how many
    modules it replaced (0 for a model without that layout)."""
    head = getattr(model, "lm_head", None)
    name = embeddings_name(model)
    if not isinstance(head, nn.Linear) or head.bias is not None or not name:
        return 0
    embeddings = model.get_submodule(name)
    tied = isinstance(embeddings, nn.Embedding) and head.weight is embeddings.weight
    blocks = head_table(model, tables or {}) or quantize_blocks8(head.weight)
    if blocks.shape != tuple(head.weight.shape):
        raise ValueError(f"Q8_0 head of {blocks.shape} for a {tuple(head.weight.shape)} head")
    held = tile(blocks) if tiled and tiles_fit(blocks) else blocks
    model.lm_head = Q8Linear(held)
    if not tied:
        return 1
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, Q8Embedding(held, embeddings.weight.dtype))
    return 2


def embeddings_name(model: CausalLM) -> str:
    """The path of the model's token embeddings ("" when it has not exactly one)."""
    found = [name for name, _ in model.named_modules() if name.endswith("embed_tokens")]
    return found[0] if len(found) == 1 else ""


def head_table(model: CausalLM, tables: dict[str, Q8Blocks]) -> Q8Blocks | None:
    """The file's table for the head: its output table, or its embedding table when tied."""
    if "lm_head" in tables:
        return tables["lm_head"]
    return tables.get("embed_tokens") if model.config.tie_word_embeddings else None


def file_tables(path: Path, model: CausalLM) -> dict[str, Q8Blocks]:
    """A GGUF file's Q8_0 embedding and output tables, by our module's last name."""
    tables = {}
    for gguf_name, _, raw in block_tensors(path, (GGMLQuantizationType.Q8_0,)):
        if gguf_name not in ("token_embd.weight", "output.weight"):
            continue
        name = hf_name(gguf_name, model.config.raw["model_type"]).removesuffix(".weight")
        tables[name.rpartition(".")[2]] = gguf_blocks8(raw)
    return tables
