"""Tensor-parallel sharding of a Llama-family model: which attention heads and MLP columns each
rank keeps, and the layers cut down to them in place (their partial outputs summed by a reduce
that the caller supplies, torch.distributed's all-reduce across ranks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import attrs
import torch
from attrs import frozen
from torch import nn

from pie.drivers.models.base import CausalLM, ModelConfig
from pie.drivers.models.layers import FusedLinear, GatedMLP
from pie.drivers.models.llama import LlamaAttention, LlamaDecoderLayer

_Layer = TypeVar("_Layer", bound=nn.Module)

SHARDED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""The architectures whose layers are exactly the Llama attention and gated MLP cut here."""

Reduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place with the same tensor on every other rank."""


@frozen(kw_only=True)
class Span:
    """A contiguous run of heads or columns: [start, start + count)."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


def split_evenly(total: int, parts: int) -> tuple[Span, ...]:
    """`total` items cut into `parts` contiguous spans whose sizes differ by at most one, the
    larger ones first (9 into 2: 5 and 4)."""
    size, extra = divmod(total, parts)
    spans, start = [], 0
    for part in range(parts):
        count = size + (1 if part < extra else 0)
        spans.append(Span(start=start, count=count))
        start += count
    return tuple(spans)


@frozen(kw_only=True)
class RankShare:
    """What rank `rank` of `ranks` computes: whole KV-head groups (each KV head with the query
    heads that read it, so grouped-query attention stays local) and a run of MLP columns."""

    rank: int
    ranks: int
    kv_heads: Span
    q_heads: Span
    ffn: Span


def rank_share(config: ModelConfig, rank: int, ranks: int) -> RankShare:
    """The share of `rank`; ValueError when the model has fewer KV heads than ranks (a rank
    would hold no head) or query heads that do not group evenly over its KV heads."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of {ranks} tensor-parallel ranks")
    kv, q = config.num_kv_heads, config.num_heads
    if ranks > kv:
        raise ValueError(
            f"tensor_parallel = {ranks} needs at least {ranks} KV heads; this model has {kv} "
            f"KV heads ({q} query heads): use at most {kv} ranks"
        )
    if q % kv:
        raise ValueError(f"{q} query heads do not group evenly over {kv} KV heads")
    group = q // kv
    kv_span = split_evenly(kv, ranks)[rank]
    return RankShare(
        rank=rank,
        ranks=ranks,
        kv_heads=kv_span,
        q_heads=Span(start=kv_span.start * group, count=kv_span.count * group),
        ffn=split_evenly(config.intermediate_size, ranks)[rank],
    )


def shard_config(config: ModelConfig, share: RankShare) -> ModelConfig:
    """The config a rank's driver sizes its KV cache and attention by: its own heads only."""
    return attrs.evolve(
        config,
        num_heads=share.q_heads.count,
        num_kv_heads=share.kv_heads.count,
        intermediate_size=share.ffn.count,
    )


class RowParallelLinear(nn.Linear):
    """A linear layer that holds some input columns of the whole one: each rank's output is a
    partial sum, which `reduce` completes. Only rank 0 holds the bias, so it is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, reduce: Reduce) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.reduce(out)
        return out


def _rows(weight: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([weight[start:stop] for start, stop in spans]).clone()


def _fused(
    source: FusedLinear, shards: list[tuple[str | int, int]], rows: list[tuple[int, int]]
) -> FusedLinear:
    """A FusedLinear of `shards` holding rows `rows` of `source` (weight and bias)."""
    fused = FusedLinear(source.in_features, shards, bias=source.bias is not None)
    fused.to(device=source.weight.device, dtype=source.weight.dtype)
    fused.weight.data.copy_(_rows(source.weight.data, rows))
    if source.bias is not None:
        assert fused.bias is not None
        fused.bias.data.copy_(_rows(source.bias.data, rows))
    return fused


def _row_parallel(source: nn.Linear, columns: Span, rank: int, reduce: Reduce) -> nn.Linear:
    keep_bias = source.bias is not None and rank == 0
    linear = RowParallelLinear(columns.count, source.out_features, keep_bias, reduce)
    linear.to(device=source.weight.device, dtype=source.weight.dtype)
    linear.weight.data.copy_(source.weight.data[:, columns.start : columns.stop])
    if keep_bias:
        assert linear.bias is not None and source.bias is not None
        linear.bias.data.copy_(source.bias.data)
    return linear


def shard_attention(attn: LlamaAttention, share: RankShare, reduce: Reduce) -> None:
    """Keeps the q, k and v rows of the rank's heads and the matching o_proj columns."""
    d, q_all, kv_all = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q, kv = share.q_heads, share.kv_heads
    rows = [
        (q.start * d, q.stop * d),
        ((q_all + kv.start) * d, (q_all + kv.stop) * d),
        ((q_all + kv_all + kv.start) * d, (q_all + kv_all + kv.stop) * d),
    ]
    shards: list[tuple[str | int, int]] = [
        ("q", q.count * d),
        ("k", kv.count * d),
        ("v", kv.count * d),
    ]
    attn.qkv_proj = _fused(_plain(attn.qkv_proj, FusedLinear), shards, rows)
    o_columns = Span(start=q.start * d, count=q.count * d)
    attn.o_proj = _row_parallel(_plain(attn.o_proj, nn.Linear), o_columns, share.rank, reduce)
    attn.num_heads, attn.num_kv_heads = q.count, kv.count


def shard_mlp(mlp: GatedMLP, share: RankShare, reduce: Reduce) -> None:
    """Keeps the rank's gate and up rows (column parallel) and the same down columns (row
    parallel)."""
    f = share.ffn
    width = mlp.down_proj.in_features
    rows = [(f.start, f.stop), (width + f.start, width + f.stop)]
    shards: list[tuple[str | int, int]] = [(0, f.count), (1, f.count)]
    mlp.gate_up_proj = _fused(_plain(mlp.gate_up_proj, FusedLinear), shards, rows)
    mlp.down_proj = _row_parallel(_plain(mlp.down_proj, nn.Linear), f, share.rank, reduce)


def _plain(module: object, kind: type[_Layer]) -> _Layer:
    """`module` when it is a float layer of exactly `kind` (not quantized, not LoRA-wrapped)."""
    if type(module) is not kind:
        raise ValueError(
            f"tensor parallelism shards float {kind.__name__} layers, not {type(module).__name__}"
            " (quantized weights and LoRA adapters run on one rank)"
        )
    assert isinstance(module, kind)
    return module


def shard_model(model: CausalLM, share: RankShare, reduce: Reduce) -> ModelConfig:
    """Cuts every decoder layer of `model` down to `share` in place; the rank's config. The
    embeddings, norms and output head stay whole on every rank."""
    layers = _decoder_layers(model)
    for layer in layers:
        assert isinstance(layer.self_attn, LlamaAttention) and isinstance(layer.mlp, GatedMLP)
        shard_attention(layer.self_attn, share, reduce)
        shard_mlp(layer.mlp, share, reduce)
    return shard_config(model.config, share)


def _decoder_layers(model: CausalLM) -> list[LlamaDecoderLayer]:
    """The model's decoder layers; ValueError for an architecture whose layers are not the
    Llama attention and gated MLP that shard_model knows how to cut."""
    body = getattr(model, "model", None)
    layers = list(getattr(body, "layers", ()))
    fits = layers and all(
        isinstance(layer, LlamaDecoderLayer)
        and isinstance(getattr(layer, "self_attn", None), LlamaAttention)
        and type(getattr(layer, "mlp", None)) is GatedMLP
        for layer in layers
    )
    if not fits or model.config.model_type not in SHARDED_TYPES:
        raise ValueError(
            f"tensor parallelism runs the text models {', '.join(SHARDED_TYPES)}, "
            f"not {model.config.model_type!r}"
        )
    return layers
