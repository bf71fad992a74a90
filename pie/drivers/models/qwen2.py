"""Qwen2 decoder: the Llama layout with biases on the q/k/v projections only."""

from __future__ import annotations

from pie.drivers.models.base import register
from pie.drivers.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    # Qwen2 always biases q/k/v (the config sets attention_bias) but never the output projection.
    o_proj_bias = False


@register("qwen2")
class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
