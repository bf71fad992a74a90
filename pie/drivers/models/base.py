"""What every model architecture provides to a driver, and the registry by HF `model_type`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from attrs import frozen
from torch import nn


class AttentionFn(Protocol):
    """Paged attention supplied by the driver for one batch.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the batch's new tokens
    (rope and any q/k norm already applied). The driver writes k, v into the KV pages and returns
    the attention output [T, num_heads, head_dim] over each token's visible kv slots.
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


@frozen(kw_only=True)
class LayerAttention:
    """What one layer's attention asks of the driver beyond plain causal softmax attention."""

    sliding_window: int | None = None
    """Each token sees at most this many kv slots, its own included (None: all before it)."""
    softcap: float | None = None
    """Scores pass through softcap * tanh(score / softcap) before the softmax (Gemma 2)."""
    scale: float | None = None
    """The factor on q.k (None: 1 / sqrt(head_dim))."""


PLAIN_ATTENTION = LayerAttention()


@frozen(kw_only=True)
class ModelConfig:
    """The architecture facts a model file and a driver need, read from an HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any]
    """The whole config.json, for architecture-specific keys."""


class CausalLM(nn.Module):
    """Base of every architecture: embeddings to hidden states, and hidden states to logits."""

    config: ModelConfig
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {}
    """HF weight name fragment -> (our fused parameter fragment, shard id), for the loader."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] (float32)."""
        raise NotImplementedError

    def rope_positions(self, positions: Sequence[int], qo_indptr: Sequence[int]) -> Sequence[int]:
        """The rows of the rotary tables a pass's tokens read (request r owns tokens
        qo_indptr[r] to qo_indptr[r + 1]): their positions, unless the architecture keeps
        several tables end to end (Phi-3's LongRoPE)."""
        return positions

    rope_types: tuple[str, ...] = ()
    """Rope scaling types this architecture implements itself, beyond layers.py's."""
    hf_defaults: dict[str, Any] = {}
    """Values of config.json keys that this architecture's transformers config class fills in
    when a file leaves them out (e.g. Qwen3's head_dim of 128)."""

    @classmethod
    def flat_hf_config(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """config.json with the language model's keys at the top level, where a multimodal
        checkpoint nests them (`text_config`); the rest of `raw` stays as it is."""
        return raw

    @classmethod
    def check_hf_config(cls, raw: dict[str, Any]) -> None:
        """Raises ValueError naming a config.json feature this implementation does not have."""
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        if raw.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=true")
        if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ()):
            raise ValueError(f"unsupported: sliding-window layers on {raw.get('model_type')!r}")

    def route_weight(self, name: str) -> tuple[str, str | int | None] | None:
        """The loader's hook for checkpoint names that `packed_modules_mapping` cannot route
        (per-expert weights): (our parameter, shard id or None), or None to use the mapping."""
        return None

    def ignores_weight(self, name: str) -> bool:
        """Checkpoint weights this implementation never uses (a codec's encoder half): the
        loader neither reads them nor reports them as unexpected."""
        return False

    def attention_layers(self) -> tuple[LayerAttention, ...]:
        """Each layer's attention options, in layer order; the driver honours every one."""
        return (PLAIN_ATTENTION,) * self.config.num_layers

    def use_kernels(self, kernels: Any) -> None:
        """Runs the layers' small operations on `kernels` (a layers.LayerKernels): every
        module that has a `kernels` attribute gets it."""
        for module in self.modules():
            if hasattr(type(module), "kernels"):
                module.kernels = kernels


MODEL_REGISTRY: dict[str, type[CausalLM]] = {}


def register(*model_types: str) -> Callable[[type[CausalLM]], type[CausalLM]]:
    def wrap(cls: type[CausalLM]) -> type[CausalLM]:
        for name in model_types:
            MODEL_REGISTRY[name] = cls
        return cls

    return wrap
