"""Mixtral decoder: Mistral attention (an optional sliding window on every layer) with a sparse
top-k expert block, renormalised over the chosen experts, in place of every dense MLP."""

from __future__ import annotations

from torch import nn

from pie.drivers.models.base import PLAIN_ATTENTION, LayerAttention, ModelConfig, register
from pie.drivers.models.moe import MoeForCausalLM, SparseMoeBlock, num_experts

_DEFAULT_EXPERTS = 8


@register("mixtral")
class MixtralForCausalLM(MoeForCausalLM):
    expert_names = {"w1": "gate", "w3": "up", "w2": "down"}
    hf_defaults = {
        "intermediate_size": 14336,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "num_experts_per_tok": 2,
    }

    def feed_forward(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            num_experts(config.raw, _DEFAULT_EXPERTS),
            top_k=config.raw["num_experts_per_tok"],
            normalize=True,
        )

    def route_weight(self, name: str) -> tuple[str, str | int | None] | None:
        # Mixtral checkpoints call the feed-forward block `block_sparse_moe`; ours is `mlp`.
        moved = name.replace(".block_sparse_moe.", ".mlp.")
        routed = super().route_weight(moved)
        if routed is None and moved != name:
            return moved, None
        return routed

    def attention_layers(self) -> tuple[LayerAttention, ...]:
        window = self.config.raw.get("sliding_window")
        layer = PLAIN_ATTENTION if window is None else LayerAttention(sliding_window=window)
        return (layer,) * self.config.num_layers
