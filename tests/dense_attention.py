"""Reference attention for model tests: plain causal softmax attention over the tokens of one
sequence, with no KV pages, grouped-query aware. It mirrors transformers' eager attention."""

from __future__ import annotations

import torch


class DenseCausalAttention:
    """An AttentionFn for a batch that is exactly one sequence, positions 0..T-1."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        tokens, heads, head_dim = q.shape
        group = heads // k.shape[1]
        # [heads, T, D], with each kv head repeated for the q heads that share it.
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = torch.matmul(q, k.transpose(1, 2)) * head_dim**-0.5
        future = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v).transpose(0, 1)
