"""The sparse mixture-of-experts feed-forward block shared by Qwen3-MoE and Mixtral, with its
experts held as stacked tensors, and the decoder scaffolding that puts it into the Llama layout."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pie.drivers.models.base import ModelConfig
from pie.drivers.models.llama import LlamaForCausalLM, LlamaModel

EXPERT_ROLES: dict[str, tuple[str, int]] = {
    "gate": ("gate_up_proj", 0),
    "up": ("gate_up_proj", 1),
    "down": ("down_proj", 0),
}
"""Each expert projection's place: (stacked parameter's module, part within an expert's rows)."""
_PARTS = {"gate_up_proj": 2, "down_proj": 1}
_EXPERT_WEIGHT = re.compile(r"(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<name>\w+)\.weight")
_STACKED_WEIGHT = re.compile(r".+\.experts\.(gate_up_proj|down_proj)")


class Router(nn.Module):
    """Scores the experts for each token and keeps the top k, with their softmax weights taken
    in float32 (renormalised over the chosen k when `normalize`). Not an nn.Linear, so int8
    weights leave it in float: a small error here changes which experts run."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        probs = F.linear(hidden, self.weight).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


class ExpertProjection(nn.Module):
    """One projection of every expert, stacked: weight [experts, parts * rows, columns]. The
    checkpoint stores it per expert and part; shard id expert * parts + part is that slice."""

    def __init__(self, num_experts: int, parts: int, rows: int, columns: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, parts * rows, columns))
        self.rows = rows
        self.shards = range(num_experts * parts)

    def load_shard(self, param: nn.Parameter, weight: torch.Tensor, shard_id: str | int) -> None:
        """Copies one expert's part (a checkpoint tensor [rows, columns]) into its slice."""
        assert isinstance(shard_id, int)
        target = param.data.view(-1, self.rows, param.shape[-1])[shard_id]
        if target.shape != weight.shape:
            raise ValueError(
                f"expert shard {shard_id}: expected {tuple(target.shape)}, "
                f"got {tuple(weight.shape)}"
            )
        target.copy_(weight)


class Experts(nn.Module):
    """Every expert's gated SiLU MLP, run once per expert on the tokens routed to it."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = ExpertProjection(num_experts, 2, intermediate_size, hidden_size)
        self.down_proj = ExpertProjection(num_experts, 1, hidden_size, intermediate_size)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """tokens [N, H] grouped by expert, counts [E] of each group -> outputs [N, H]."""
        if grouped_mm_runs(tokens):
            return self._grouped(tokens, counts)
        return self._per_expert(tokens, counts)

    def _grouped(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # One grouped GEMM for all experts: no host sync on the group sizes, so it can be
        # captured in a CUDA graph.
        offsets = counts.cumsum(0, dtype=torch.int32)
        gate_up = F.grouped_mm(tokens, self.gate_up_proj.weight.transpose(1, 2), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down_proj.weight.transpose(1, 2), offs=offsets)

    def _per_expert(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        groups = tokens.split(counts.tolist())
        return torch.cat(
            [self._expert(e, group) for e, group in enumerate(groups) if group.shape[0]]
        )

    def _expert(self, expert: int, tokens: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(tokens, self.gate_up_proj.weight[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj.weight[expert])


def grouped_mm_runs(tokens: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these tokens: on the CPU in any float dtype the model
    runs, on CUDA in bfloat16 from compute capability 8.0."""
    if tokens.device.type == "cpu":
        return True
    return (
        tokens.device.type == "cuda"
        and tokens.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(tokens.device) >= (8, 0)
    )


class SparseMoeBlock(nn.Module):
    """Each token through its top-k experts, their outputs summed with the router's weights.
    The flat batch is sorted by expert so each expert runs once on all of its tokens."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, normalize)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.num_experts = num_experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(hidden)
        chosen = experts.flatten()
        order = chosen.argsort(stable=True)
        counts = torch.bincount(chosen, minlength=self.num_experts)
        grouped = self.experts(hidden.index_select(0, order // weights.shape[1]), counts)
        # Back to token order, [T, k, H]; summing over k (not scatter-adding) keeps the result
        # independent of how the batch happened to group.
        outputs = torch.empty_like(grouped).index_copy_(0, order, grouped)
        outputs = outputs.view(*weights.shape, -1).float() * weights.unsqueeze(-1)
        return outputs.sum(dim=1).to(hidden.dtype)


def route_expert_weight(name: str, roles: Mapping[str, str]) -> tuple[str, int | None] | None:
    """A checkpoint's per-expert weight name (`...experts.3.gate_proj.weight`) -> (our stacked
    parameter, shard id), or its already stacked one (`...experts.gate_up_proj`, the layout
    transformers keeps in memory) -> (our parameter, None); None for other names. `roles` maps
    the checkpoint's projection names to "gate", "up" and "down"."""
    if _STACKED_WEIGHT.fullmatch(name):
        return f"{name}.weight", None
    match = _EXPERT_WEIGHT.fullmatch(name)
    if match is None or match["name"] not in roles:
        return None
    module, part = EXPERT_ROLES[roles[match["name"]]]
    shard = int(match["index"]) * _PARTS[module] + part
    return f"{match['experts']}.{module}.weight", shard


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-layout decoder whose layers take their feed-forward block from `feed_forward`."""

    expert_names: Mapping[str, str] = {}
    """The checkpoint's per-expert projection names -> "gate", "up" or "down"."""

    def body(self, config: ModelConfig) -> nn.Module:
        return LlamaModel(config, self.attention_cls, self.feed_forward)

    def feed_forward(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def route_weight(self, name: str) -> tuple[str, str | int | None] | None:
        """The loader's hook: where a checkpoint weight goes when packed_modules_mapping cannot
        say (per-expert weights); None leaves it to the mapping."""
        return route_expert_weight(name, self.expert_names)


def num_experts(raw: Mapping[str, Any], default: int) -> int:
    """The expert count under either of its config.json names (transformers writes
    `num_local_experts`; Qwen's own files say `num_experts`)."""
    return int(raw.get("num_local_experts", raw.get("num_experts", default)))
