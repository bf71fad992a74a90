"""Llama decoder (Llama 2/3, SmolLM2, Mistral-style dense models) over a flat token batch."""

from __future__ import annotations

import torch
from torch import nn

from pie.drivers.models.base import AttentionFn, CausalLM, ModelConfig, register
from pie.drivers.models.layers import (
    GatedMLP,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    apply_rotary,
    qkv_projection,
)


class LlamaAttention(nn.Module):
    """Fused qkv projection, rope, the driver's attention, output projection."""

    o_proj_bias: bool | None = None
    """None: follow config.attention_bias; an architecture may pin it."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.qkv_proj = qkv_projection(
            config.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            bias=config.attention_bias,
        )
        o_bias = config.attention_bias if self.o_proj_bias is None else self.o_proj_bias
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> q [T, Hq, D], k and v [T, Hkv, D], before rope."""
        q, k, v = self.qkv_proj.forward_split(hidden)
        return (
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
        )

    def forward(self, hidden: torch.Tensor, rope: Rope, attention: AttentionFn) -> torch.Tensor:
        q, k, v = self.project(hidden)
        out = attention(self.layer_idx, apply_rotary(q, rope), apply_rotary(k, rope), v)
        return self.o_proj(out.flatten(1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then gated MLP."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, attention_cls: type[LlamaAttention]
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope: Rope, attention: AttentionFn) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, attention)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Token embeddings, the decoder stack and the final norm."""

    def __init__(self, config: ModelConfig, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attention_cls) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions)
        for layer in self.layers:
            hidden = layer(hidden, rope, attention)
        return self.norm(hidden)


@register("llama")
class LlamaForCausalLM(CausalLM):
    attention_cls: type[LlamaAttention] = LlamaAttention
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_cls)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
