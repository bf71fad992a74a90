"""Qwen3-MoE decoder: Qwen3 attention (q/k norm) with sparse expert blocks on every
`decoder_sparse_step`-th layer and dense MLPs on the `mlp_only_layers`."""

from __future__ import annotations

from typing import Any

from torch import nn

from pie.drivers.models.base import ModelConfig, register
from pie.drivers.models.layers import GatedMLP
from pie.drivers.models.moe import MoeForCausalLM, SparseMoeBlock, num_experts
from pie.drivers.models.qwen3 import Qwen3Attention

_DEFAULT_EXPERTS = 128


@register("qwen3_moe")
class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen3Attention
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    hf_defaults = {
        "intermediate_size": 6144,
        "max_position_embeddings": 32768,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
    }

    def feed_forward(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        raw = config.raw
        experts = num_experts(raw, _DEFAULT_EXPERTS)
        if not _is_sparse(raw, experts, layer_idx):
            return GatedMLP(config.hidden_size, config.intermediate_size)
        return SparseMoeBlock(
            config.hidden_size,
            raw["moe_intermediate_size"],
            experts,
            top_k=raw["num_experts_per_tok"],
            normalize=bool(raw["norm_topk_prob"]),
        )


def _is_sparse(raw: dict[str, Any], experts: int, layer_idx: int) -> bool:
    if layer_idx in raw["mlp_only_layers"] or experts == 0:
        return False
    return (layer_idx + 1) % raw["decoder_sparse_step"] == 0
