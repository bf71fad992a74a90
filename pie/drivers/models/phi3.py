"""Phi-3 / Phi-3.5 / Phi-4-mini decoder: Mistral's layout (a sliding window on every layer when
the config sets one) with q/k/v and gate/up stored fused in the checkpoint, rotary embedding on
the leading `partial_rotary_factor` of each head only, and LongRoPE."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from attrs import evolve

from pie.drivers.models.base import AttentionFn, ModelConfig, register
from pie.drivers.models.layers import RotaryEmbedding
from pie.drivers.models.llama import LlamaAttention
from pie.drivers.models.mistral import MistralAttention, MistralForCausalLM

LONGROPE_NAMES = ("longrope", "su", "yarn")
"""transformers reads Phi-3's older names for LongRoPE ("su", "yarn") as LongRoPE."""


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})


def rope_type(raw: dict[str, Any]) -> str:
    params = rope_parameters(raw)
    return str(params.get("rope_type") or params.get("type") or "default")


def rotary_dim(config: ModelConfig) -> int:
    """How many leading channels of each head rope rotates."""
    factor = rope_parameters(config.raw).get(
        "partial_rotary_factor", config.raw.get("partial_rotary_factor", 1.0)
    )
    return int(config.head_dim * factor)


class LongRope(RotaryEmbedding):
    """LongRoPE's tables: each frequency divided by its own rescale factor, and cos and sin
    multiplied by the attention factor (which so scales both q and k). A model that holds
    positions past its original length gets two tables end to end: the short factors for
    positions [0, original), then the long factors for every position, read from row
    `long_offset` + position (see `Phi3ForCausalLM.rope_positions`)."""

    def __init__(
        self,
        dim: int,
        max_positions: int,
        theta: float,
        factors: Sequence[Sequence[float]],
        attention_factor: float,
        long_offset: int | None = None,
    ) -> None:
        """`factors`: the short rescale factors, then (with `long_offset`) the long ones."""
        rows = max_positions if long_offset is None else long_offset + max_positions
        super().__init__(dim, rows, theta, None)
        self.long_offset = long_offset
        spans = [max_positions] if long_offset is None else [long_offset, max_positions]
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        tables = []
        for rescale, span in zip(factors, spans, strict=True):
            inv_freq = 1.0 / (torch.tensor(rescale, dtype=torch.float32) * theta**exponents)
            tables.append(torch.arange(span, dtype=torch.float32)[:, None] * inv_freq[None, :])
        angles = torch.cat(tables)
        self.cos.copy_(angles.cos() * attention_factor)
        self.sin.copy_(angles.sin() * attention_factor)


def longrope(config: ModelConfig) -> LongRope:
    """transformers rotates a forward pass with the short factors while its furthest position
    is inside original_max_position_embeddings and with the long ones past it (its generate
    re-encodes the sequence when it first grows past). Here the choice is made per request of
    a pass: a model that holds positions past the original length has both tables, and a
    request whose furthest position in the pass is past it reads the long one; keys already
    written keep their rotation."""
    params = rope_parameters(config.raw)
    original = int(config.raw["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0
        if factor > 1.0:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    dim = rotary_dim(config)
    long_context = config.max_position_embeddings > original
    keys = ("short_factor", "long_factor") if long_context else ("short_factor",)
    factors = []
    for key in keys:
        rescale = params.get(key)
        if not isinstance(rescale, list) or len(rescale) != dim // 2:
            raise ValueError(f"longrope needs a {key} of {dim // 2} numbers, not {rescale!r}")
        factors.append(rescale)
    return LongRope(
        dim,
        config.max_position_embeddings,
        config.rope_theta,
        factors,
        float(attention_factor),
        original if long_context else None,
    )


def phi3_rotary(config: ModelConfig) -> RotaryEmbedding:
    if rope_type(config.raw) in LONGROPE_NAMES:
        return longrope(config)
    return RotaryEmbedding(
        rotary_dim(config), config.max_position_embeddings, config.rope_theta, None
    )


class Phi3Attention(MistralAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.rotary_dim = rotary_dim(config)

    def forward(self, hidden: torch.Tensor, rope: Any, attention: AttentionFn) -> torch.Tensor:
        q, k, v = self.project(hidden)
        q, k = self.rotate(q, k, rope)
        return self.o_proj(attention(self.layer_idx, q, k, v).flatten(1))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: Any) -> tuple[torch.Tensor, ...]:
        """Rope over the leading rotary_dim channels of each head; the rest pass unchanged."""
        d = self.rotary_dim
        if d == self.head_dim:
            return self.kernels.rotate(q, k, rope)
        # Contiguous copies: a fused kernel rotates whole rows in place.
        q_rot, k_rot = self.kernels.rotate(q[..., :d].contiguous(), k[..., :d].contiguous(), rope)
        return torch.cat((q_rot, q[..., d:]), dim=-1), torch.cat((k_rot, k[..., d:]), dim=-1)


@register("phi3")
class Phi3ForCausalLM(MistralForCausalLM):
    attention_cls: type[LlamaAttention] = Phi3Attention
    rope_types = LONGROPE_NAMES
    """Rope types this file implements beyond layers.SUPPORTED_ROPE_TYPES."""
    # The checkpoint stores qkv_proj and gate_up_proj fused already, in our order.
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {}
    hf_defaults: dict[str, Any] = {
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    }

    def __init__(self, config: ModelConfig) -> None:
        # Llama's rotary table knows neither a partial width nor LongRoPE: the decoder is built
        # without rope scaling and then given Phi-3's table.
        super().__init__(evolve(config, rope_scaling=None))
        self.config = config
        self.model.rotary_emb = phi3_rotary(config)

    def rope_positions(self, positions: Sequence[int], qo_indptr: Sequence[int]) -> Sequence[int]:
        """Each request of the pass whose furthest position is past the original length reads
        LongRoPE's long table (its rows start at `long_offset`)."""
        rotary = self.model.rotary_emb
        offset = rotary.long_offset if isinstance(rotary, LongRope) else None
        if offset is None or not positions or max(positions) < offset:
            return positions
        out = list(positions)
        for start, end in zip(qo_indptr, qo_indptr[1:], strict=False):
            if end > start and max(positions[start:end]) >= offset:
                out[start:end] = [p + offset for p in positions[start:end]]
        return out

    @classmethod
    def check_hf_config(cls, raw: dict[str, Any]) -> None:
        kind = rope_type(raw)
        if kind not in ("default", *LONGROPE_NAMES):
            raise ValueError(
                f"unsupported rope type {kind!r} on phi3; supported: default, longrope"
            )
        super().check_hf_config(raw)
