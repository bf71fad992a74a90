"""Tensor-parallel shards in one process: each rank's cut-down attention and MLP, their partial
outputs summed, give the whole layer's output on random weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.models import ModelConfig, build_model
from pie.drivers.tensor_parallel import Span, rank_share, shard_model, split_evenly

# 9 query heads over 3 KV heads, as the default model (SmolLM2-135M) has; an odd MLP width.
TINY = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 72,
    "intermediate_size": 51,
    "num_hidden_layers": 2,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "attention_bias": True,
}


def _config(**changes: object) -> ModelConfig:
    return model_config_from_hf({**TINY, **changes})


def _model(config: ModelConfig) -> torch.nn.Module:
    model = build_model(config, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def _causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Plain causal grouped-query attention over one sequence (what a driver's pages give)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
    return out.transpose(0, 1)


def _shards(model: torch.nn.Module, config: ModelConfig, ranks: int) -> list[torch.nn.Module]:
    shards = []
    for rank in range(ranks):
        shard = copy.deepcopy(model)
        shard_model(shard, rank_share(config, rank, ranks), lambda t: None)
        shards.append(shard)
    return shards


@pytest.mark.unit
def test_uneven_counts_split_into_contiguous_runs_larger_first() -> None:
    assert split_evenly(9, 2) == (Span(start=0, count=5), Span(start=5, count=4))
    assert split_evenly(3, 3) == tuple(Span(start=i, count=1) for i in range(3))


@pytest.mark.unit
def test_two_ranks_split_the_default_models_kv_groups_two_and_one() -> None:
    config = _config()
    first, second = (rank_share(config, r, 2) for r in range(2))
    assert (first.kv_heads, first.q_heads) == (Span(start=0, count=2), Span(start=0, count=6))
    assert (second.kv_heads, second.q_heads) == (Span(start=2, count=1), Span(start=6, count=3))
    assert (first.ffn.count, second.ffn.count) == (26, 25)


@pytest.mark.unit
def test_more_ranks_than_kv_heads_is_refused_naming_the_counts() -> None:
    with pytest.raises(
        ValueError,
        match="tensor_parallel = 4 needs at least 4 KV heads; this "
        r"model has 3 KV heads \(9 query heads\)",
    ):
        rank_share(_config(), 0, 4)


@pytest.mark.unit
@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_attention_and_mlp_sum_to_the_whole_layer(ranks: int) -> None:
    config = _config()
    model = _model(config)
    shards = _shards(model, config, ranks)
    hidden = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(5)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            rope = model.model.rotary_emb(positions)
            parts = [s.model.layers[i] for s in shards]
            whole = layer.self_attn(hidden, rope, _causal_attention)
            summed = sum(p.self_attn(hidden, rope, _causal_attention) for p in parts)
            torch.testing.assert_close(summed, whole, atol=1e-5, rtol=1e-5)
            summed_mlp = sum(p.mlp(hidden) for p in parts)
            torch.testing.assert_close(summed_mlp, layer.mlp(hidden), atol=1e-5, rtol=1e-5)


@pytest.mark.unit
def test_each_rank_holds_only_its_heads_and_columns() -> None:
    config = _config()
    first, second = _shards(_model(config), config, 2)
    attn = second.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
    assert attn.qkv_proj.weight.shape == ((3 + 1 + 1) * 8, 72)
    assert attn.o_proj.weight.shape == (72, 3 * 8)
    assert first.model.layers[0].self_attn.o_proj.bias is not None
    assert attn.o_proj.bias is None
    assert second.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 25, 72)


@pytest.mark.unit
def test_an_architecture_it_cannot_cut_is_refused() -> None:
    config = model_config_from_hf({**TINY, "model_type": "olmo2"})
    model = _model(config)
    with pytest.raises(ValueError, match="tensor parallelism runs the text models"):
        shard_model(model, rank_share(config, 0, 2), lambda t: None)
