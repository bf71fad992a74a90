"""Qwen2 decoder: the Llama layout with biases on the q/k/v projections only."""

from __future__ import annotations

from pie.drivers.models.base import register
from pie.drivers.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    # Qwen2 always biases q/k/v (its config has no attention_bias key) but never the output.
    qkv_bias = True
    o_proj_bias = False


@register("qwen2")
class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
    hf_defaults = {"max_position_embeddings": 32768}
