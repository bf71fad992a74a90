"""OLMo 2 decoder: norms on the attention and MLP outputs before each residual add (no norm on
a layer's input), and RMSNorm over the whole projected q and k, before rope."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pie.drivers.models.base import AttentionFn, ModelConfig, register
from pie.drivers.models.layers import (
    TORCH_KERNELS,
    GatedMLP,
    LayerKernels,
    RMSNorm,
    RotaryEmbedding,
)
from pie.drivers.models.llama import LlamaAttention, LlamaForCausalLM


class Olmo2RMSNorm(RMSNorm):
    """RMSNorm scaled by its weight before the cast back to the input dtype (OLMo 2's order;
    Llama's scales after), so that bf16 rounds as the reference does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = Olmo2RMSNorm(config.num_heads * config.head_dim, config.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(config.num_kv_heads * config.head_dim, config.rms_norm_eps)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj.forward_split(hidden)
        return (
            self.q_norm(q).view(-1, self.num_heads, self.head_dim),
            self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
        )


class Olmo2DecoderLayer(nn.Module):
    """h + norm(attention(h)), then that plus norm(mlp(that))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope: Any, attention: AttentionFn) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, rope, attention))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2Model(nn.Module):
    """Token embeddings, the post-norm decoder stack and the final norm."""

    kernels: LayerKernels = TORCH_KERNELS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.for_config(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.kernels.rope(positions, self.rotary_emb)
        for layer in self.layers:
            hidden = layer(hidden, rope, attention)
        return self.norm(hidden)


@register("olmo2")
class Olmo2ForCausalLM(LlamaForCausalLM):
    hf_defaults: dict[str, Any] = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5}

    def body(self, config: ModelConfig) -> nn.Module:
        return Olmo2Model(config)
