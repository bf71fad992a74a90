"""Qwen3 decoder: the Llama layout plus a per-head RMSNorm on q and k before rope."""

from __future__ import annotations

import torch

from pie.drivers.models.base import ModelConfig, register
from pie.drivers.models.layers import RMSNorm
from pie.drivers.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(hidden)
        return self.q_norm(q), self.k_norm(k), v


@register("qwen3")
class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
    hf_defaults = {"head_dim": 128, "max_position_embeddings": 32768}
