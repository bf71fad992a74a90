"""Llama decoder (Llama 2/3, SmolLM2, Mistral-style dense models) over a flat token batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pie.drivers.models.base import AttentionFn, CausalLM, ModelConfig, register
from pie.drivers.models.layers import (
    TORCH_KERNELS,
    GatedMLP,
    LayerKernels,
    RMSNorm,
    RotaryEmbedding,
    qkv_projection,
)


class LlamaAttention(nn.Module):
    """Fused qkv projection, rope, the driver's attention, output projection."""

    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    """None: follow config.attention_bias; an architecture may pin either."""
    kernels: LayerKernels = TORCH_KERNELS

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
            bias=config.attention_bias if self.qkv_bias is None else self.qkv_bias,
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

    def forward(self, hidden: torch.Tensor, rope: Any, attention: AttentionFn) -> torch.Tensor:
        q, k, v = self.project(hidden)
        q, k = self.kernels.rotate(q, k, rope)
        return self.o_proj(attention(self.layer_idx, q, k, v).flatten(1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then gated MLP."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        attention_cls: type[LlamaAttention],
        mlp: nn.Module | None = None,
    ) -> None:
        """`mlp`: the feed-forward block on [T, H] (None: the gated SiLU MLP of the config)."""
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx)
        self.mlp: nn.Module = mlp or GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Any,
        attention: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream before it is added: the next layer adds
        them inside its first norm, where a fused kernel does both at once."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, rope, attention)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Token embeddings, the decoder stack and the final norm."""

    kernels: LayerKernels = TORCH_KERNELS

    def __init__(
        self,
        config: ModelConfig,
        attention_cls: type[LlamaAttention],
        feed_forward: Callable[[ModelConfig, int], nn.Module] | None = None,
    ) -> None:
        """`feed_forward(config, layer)`: each layer's feed-forward block (None: the gated MLP)."""
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, i, attention_cls, feed_forward(config, i) if feed_forward else None
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.for_config(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        return self.decode(self.embed_tokens(input_ids), positions, attention)

    def decode(
        self, hidden: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """The decoder stack and the final norm over input embeddings [T, H]."""
        return self.run_layers(hidden, self.kernels.rope(positions, self.rotary_emb), attention)

    def run_layers(self, hidden: torch.Tensor, rope: Any, attention: AttentionFn) -> torch.Tensor:
        """The decoder stack and the final norm over input embeddings, with the rotary tables
        built already (a model with several rope dimensions builds its own)."""
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, attention)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_forward(hidden, residual)[0]


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
        self.model = self.body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            embeddings = self.model.get_submodule("embed_tokens")
            assert isinstance(embeddings, nn.Embedding)
            self.lm_head.weight = embeddings.weight

    def body(self, config: ModelConfig) -> nn.Module:
        """Embeddings, the decoder stack and the final norm: hidden states from token ids."""
        return LlamaModel(config, self.attention_cls)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
