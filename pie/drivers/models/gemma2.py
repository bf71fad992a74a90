"""Gemma 2 decoder, and the pieces Gemma 3 shares with it: (1 + w) norms, scaled embeddings, a
GELU-tanh gated MLP, norms before and after both attention and MLP, per-layer attention options."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pie.drivers.models.base import (
    AttentionFn,
    CausalLM,
    LayerAttention,
    ModelConfig,
    register,
)
from pie.drivers.models.layers import (
    TORCH_KERNELS,
    GatedMLP,
    LayerKernels,
    RotaryEmbedding,
)
from pie.drivers.models.llama import LlamaAttention, LlamaForCausalLM

SLIDING = "sliding_attention"
FULL = "full_attention"


class GemmaRMSNorm(nn.Module):
    """RMS norm scaled by (1 + weight), all in float32 before the cast back (a checkpoint's
    weight is the offset from one, so a fresh norm holds zeros)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Attention and MLP, each between a norm of its input and a norm of its output."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, attention_cls: type[LlamaAttention]
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attention_cls(config, layer_idx)
        self.mlp = GemmaMLP(size, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, hidden: torch.Tensor, rope: Any, attention: AttentionFn) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rope, attention)
        hidden = hidden + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mixed)


class GemmaModel(nn.Module):
    """Scaled token embeddings, the decoder stack and the final norm; `ropes` holds the rotary
    tables by name and `layer_ropes` names the one each layer uses."""

    kernels: LayerKernels = TORCH_KERNELS
    embed_scale: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        attention_cls: type[LlamaAttention],
        ropes: dict[str, RotaryEmbedding],
        layer_ropes: Sequence[str],
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Like the reference, the factor is rounded to the weights' dtype before it multiplies.
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5, dtype=torch.float32), False
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, attention_cls) for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = nn.ModuleDict(ropes)
        self.layer_ropes = tuple(layer_ropes)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        ropes = {
            name: self.kernels.rope(positions, cast(RotaryEmbedding, table))
            for name, table in self.rotary.items()
        }
        for layer, rope in zip(self.layers, self.layer_ropes, strict=True):
            hidden = layer(hidden, ropes[rope], attention)
        return self.norm(hidden)


def layer_types(raw: dict[str, Any], pattern: int) -> tuple[str, ...]:
    """Each layer's kind from `layer_types`, else every `pattern`-th layer full and the rest
    sliding (the rule transformers applies to configs written before layer_types existed)."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(raw["num_hidden_layers"]))


def check_gemma_config(raw: dict[str, Any], kinds: Sequence[str]) -> None:
    """ValueError for what the Gemma model files do not implement."""
    act = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {act!r}; only 'gelu_pytorch_tanh'")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("unsupported: use_bidirectional_attention=true")
    unknown = sorted(set(kinds) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: {[SLIDING, FULL]}")
    if len(kinds) != raw["num_hidden_layers"]:
        raise ValueError(f"{len(kinds)} layer_types for {raw['num_hidden_layers']} layers")
    if SLIDING in kinds and not raw.get("sliding_window"):
        raise ValueError("sliding_attention layers need a sliding_window")


@register("gemma2")
class Gemma2ForCausalLM(CausalLM):
    """Gemma 2: one rotary table; soft-capped attention scores and final logits."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    hf_defaults = {
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        ropes, layer_ropes = self.rope_tables(config)
        self.model = GemmaModel(config, self.attention_cls, ropes, layer_ropes)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def rope_tables(cls, config: ModelConfig) -> tuple[dict[str, RotaryEmbedding], list[str]]:
        """The rotary tables by name, and the name of each layer's table."""
        table = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        return {"rope": table}, ["rope"] * config.num_layers

    @classmethod
    def layer_kinds(cls, raw: dict[str, Any]) -> tuple[str, ...]:
        """Each layer's kind, SLIDING or FULL: every other one slides when unlisted."""
        return layer_types(raw, pattern=2)

    @classmethod
    def check_hf_config(cls, raw: dict[str, Any]) -> None:
        check_gemma_config(raw, cls.layer_kinds(raw))

    def attention_softcap(self) -> float | None:
        value = self.config.raw.get("attn_logit_softcapping")
        return None if value is None else float(value)

    def attention_layers(self) -> tuple[LayerAttention, ...]:
        raw = self.config.raw
        window, softcap = raw.get("sliding_window"), self.attention_softcap()
        scale = float(raw["query_pre_attn_scalar"]) ** -0.5
        return tuple(
            LayerAttention(
                sliding_window=window if kind == SLIDING else None, softcap=softcap, scale=scale
            )
            for kind in self.layer_kinds(raw)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.raw.get("final_logit_softcapping")
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
