"""Reference attention for model tests: plain causal softmax attention over the tokens of one
sequence, with no KV pages, grouped-query aware, honouring each layer's sliding window, score
soft-cap and scale. It mirrors transformers' eager attention."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pie.drivers.models.base import PLAIN_ATTENTION, CausalLM, LayerAttention


class DenseCausalAttention:
    """An AttentionFn for a batch that is exactly one sequence, positions 0..T-1; `layers` are
    the model's per-layer options (CausalLM.attention_layers; empty: all plain)."""

    def __init__(self, layers: Sequence[LayerAttention] = ()) -> None:
        self.layers = tuple(layers)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        spec = self.layers[layer] if layer < len(self.layers) else PLAIN_ATTENTION
        tokens, heads, head_dim = q.shape
        group = heads // k.shape[1]
        # [heads, T, D], with each kv head repeated for the q heads that share it.
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scale = head_dim**-0.5 if spec.scale is None else spec.scale
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        hidden = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
        if spec.sliding_window is not None:
            hidden |= torch.ones(tokens, tokens, dtype=torch.bool).tril(-spec.sliding_window)
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v).transpose(0, 1)


def dense_logits(
    model: CausalLM, ids: torch.Tensor, layers: Sequence[LayerAttention] | None = None
) -> torch.Tensor:
    """float32 logits of `model` over `ids` as one sequence at positions 0..T-1, through the
    dense reference with `layers` (None: the model's own per-layer options)."""
    attention = DenseCausalAttention(model.attention_layers() if layers is None else layers)
    positions = torch.tensor(model.rope_positions(range(ids.numel()), [0, ids.numel()]))
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, attention))
