"""Gemma 3 text decoder: Gemma 2's layout with a per-head (1 + w) norm on q and k, five sliding
layers to each global one, and a rotary table of its own for each of the two kinds."""

from __future__ import annotations

from typing import Any

import torch

from pie.drivers.models.base import ModelConfig, register
from pie.drivers.models.gemma2 import (
    FULL,
    SLIDING,
    Gemma2ForCausalLM,
    GemmaRMSNorm,
    check_gemma_config,
    layer_types,
)
from pie.drivers.models.layers import SUPPORTED_ROPE_TYPES, RotaryEmbedding
from pie.drivers.models.llama import LlamaAttention

_DEFAULT_THETA = {SLIDING: 10_000.0, FULL: 1_000_000.0}


class Gemma3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(hidden)
        return self.q_norm(q), self.k_norm(k), v


def rope_arguments(raw: dict[str, Any], kind: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) of one layer kind's rotary table, from the nested
    `rope_parameters` of transformers 5 or the older `rope_theta` / `rope_scaling` (global
    layers) and `rope_local_base_freq` (sliding layers)."""
    nested = raw.get("rope_parameters") or {}
    if kind in nested:
        params = dict(nested[kind])
    elif kind == SLIDING:
        params = {"rope_theta": raw.get("rope_local_base_freq", _DEFAULT_THETA[SLIDING])}
    else:
        params = {"rope_theta": raw.get("rope_theta", _DEFAULT_THETA[FULL])}
        params |= raw.get("rope_scaling") or {}
    theta = float(params.pop("rope_theta", _DEFAULT_THETA[kind]))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} for {kind}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **params}


@register("gemma3_text")
class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = Gemma3Attention
    hf_defaults = {
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "max_position_embeddings": 131_072,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
    }

    @classmethod
    def layer_kinds(cls, raw: dict[str, Any]) -> tuple[str, ...]:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        return layer_types(raw, pattern=int(pattern))

    @classmethod
    def rope_tables(cls, config: ModelConfig) -> tuple[dict[str, RotaryEmbedding], list[str]]:
        kinds = cls.layer_kinds(config.raw)
        tables = {
            kind: RotaryEmbedding(
                config.head_dim,
                config.max_position_embeddings,
                *rope_arguments(config.raw, kind),
            )
            for kind in sorted(set(kinds))
        }
        return tables, list(kinds)

    @classmethod
    def check_hf_config(cls, raw: dict[str, Any]) -> None:
        kinds = cls.layer_kinds(raw)
        check_gemma_config(raw, kinds)
        for kind in set(kinds):
            rope_arguments(raw, kind)

    def attention_softcap(self) -> float | None:
        # transformers' Gemma 3 reads attn_logit_softcapping but never applies it.
        return None
