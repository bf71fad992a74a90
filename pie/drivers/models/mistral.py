"""Mistral decoder: the Llama layout with no biases and one sliding attention window, from
config.json's `sliding_window`, on every layer."""

from __future__ import annotations

from typing import Any

from pie.drivers.models.base import LayerAttention, ModelConfig, register
from pie.drivers.models.llama import LlamaAttention, LlamaForCausalLM


def sliding_window(config: ModelConfig) -> int | None:
    """config.json's `sliding_window` (null: full attention), or None where it covers every
    position the model holds: the engine then keeps no window to slide."""
    window = config.raw.get("sliding_window")
    if window is None or window >= config.max_position_embeddings:
        return None
    return int(window)


def check_sliding_window(raw: dict[str, Any]) -> None:
    window = raw.get("sliding_window")
    if window is not None and (type(window) is not int or window < 1):
        raise ValueError(f"sliding_window must be a positive integer or null, not {window!r}")


class MistralAttention(LlamaAttention):
    # Mistral's projections never have biases, whatever the config says.
    qkv_bias = False
    o_proj_bias = False


@register("mistral")
class MistralForCausalLM(LlamaForCausalLM):
    attention_cls: type[LlamaAttention] = MistralAttention
    # transformers' defaults: a file that leaves `sliding_window` out slides over 4096 tokens;
    # one that sets it to null (Mistral v0.2 on) attends to everything.
    hf_defaults: dict[str, Any] = {"max_position_embeddings": 4096 * 32, "sliding_window": 4096}

    @classmethod
    def check_hf_config(cls, raw: dict[str, Any]) -> None:
        check_sliding_window(raw)
        super().check_hf_config(raw)

    def attention_layers(self) -> tuple[LayerAttention, ...]:
        layer = LayerAttention(sliding_window=sliding_window(self.config))
        return (layer,) * self.config.num_layers
