"""LoRA adapters from PEFT folders, applied per token: reading and checking a folder against
the model, mapping its weights onto the model's linear layers (fused q/k/v and gate/up
included), and the wrapped layers that add each token's own adapter's low-rank update."""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import field, frozen
from safetensors import safe_open
from torch import nn

from pie.drivers.batch import ForwardBatch
from pie.drivers.models.base import CausalLM
from pie.drivers.models.layers import FusedLinear, SplitOutput

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_WEIGHT_NAME = re.compile(r"base_model\.model\.(?P<layer>.+)\.lora_(?P<side>[AB])\.weight")
_MUST_BE_OFF = (
    "modules_to_save",
    "use_dora",
    "lora_bias",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
)
"""adapter_config.json keys whose feature changes what the adapter computes beyond
y = W x + scale * B A x on linear layers: each must be absent, null, false or empty."""

Layer = tuple[str, str | int | None]
"""Our module path and, in a fused projection, the shard a PEFT layer is (None: the whole)."""
Piece = tuple[str | int | None, torch.Tensor, torch.Tensor]
"""One PEFT layer's update within our module: its shard, A, and B scaled."""


@frozen(kw_only=True)
class AdapterConfig:
    """What adapter_config.json says about the update: y = base(x) + scale * B(A(x))."""

    rank: int
    alpha: float
    rslora: bool = False
    targets: tuple[str, ...] | str = ()
    """PEFT's target_modules: names (matching a layer's name or its last dotted parts) or a
    regular expression the whole layer name must match ("all-linear": every linear layer)."""

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@frozen(kw_only=True)
class Adapter:
    """One loaded adapter: per adapted module of ours, A [R, in] and B [out, R] with the scale
    folded into B (shards a fused module's adapter leaves alone have zero rows in B)."""

    name: str
    rank: int
    updates: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(factory=dict)


def read_adapter_config(folder: Path) -> AdapterConfig:
    """The folder's adapter_config.json; ValueError naming the file and key when it asks for a
    feature this loader does not implement."""
    path = Path(folder) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (a PEFT adapter folder has one)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    _check_features(path, raw)
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if type(rank) is not int or rank < 1:
        raise ValueError(f"{path}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        targets = tuple(targets)
    elif not isinstance(targets, str):
        raise ValueError(f"{path}: target_modules must be a list of names or a regular expression")
    return AdapterConfig(
        rank=rank, alpha=float(alpha), rslora=bool(raw.get("use_rslora")), targets=targets
    )


def _check_features(path: Path, raw: dict[str, Any]) -> None:
    # fan_in_fan_out only says how to merge B A into GPT-2 style Conv1D weights; our layers are
    # nn.Linear (as PEFT itself treats them), so the unmerged update is the same either way.
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{path}: peft_type {peft_type!r} is not supported, only LORA")
    if raw.get("bias", "none") != "none":
        raise ValueError(f'{path}: bias = {raw["bias"]!r} is not supported, only "none"')
    for key in _MUST_BE_OFF:
        if raw.get(key):
            raise ValueError(f"{path}: {key} = {raw[key]!r} is not supported")


def adaptable_layers(model: CausalLM) -> dict[str, Layer]:
    """Every linear layer of the decoder (not the output head) under its PEFT (HF) name, e.g.
    model.layers.0.self_attn.q_proj -> (model.layers.0.self_attn.qkv_proj, "q")."""
    unfused: dict[str, list[tuple[str, str | int]]] = {}
    for fragment, (fused, shard) in model.packed_modules_mapping.items():
        unfused.setdefault(fused, []).append((fragment, shard))
    layers: dict[str, Layer] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or path.endswith("lm_head"):
            continue
        parent, _, leaf = path.rpartition(".")
        if isinstance(module, FusedLinear):
            for fragment, shard in unfused.get(leaf, []):
                layers[f"{parent}.{fragment}"] = (path, shard)
        else:
            layers[path] = (path, None)
    return layers


def targeted(name: str, targets: tuple[str, ...] | str) -> bool:
    """Whether a layer name is one of PEFT's target_modules."""
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in targets)


def load_adapter(name: str, folder: str | Path, model: CausalLM) -> Adapter:
    """Reads a PEFT LoRA folder and maps it onto `model`, on the model's device and dtype;
    ValueError naming the file and the weight or key that does not fit the model."""
    folder = Path(folder)
    config = read_adapter_config(folder)
    layers = adaptable_layers(model)
    _check_targets(folder / CONFIG_FILE, config.targets, layers)
    pieces: dict[str, list[Piece]] = {}
    for layer, (a, b) in _read_pairs(folder / WEIGHTS_FILE, layers).items():
        path, shard = layers[layer]
        expected = _shapes(_linear(model, path), shard, config.rank)
        if (tuple(a.shape), tuple(b.shape)) != expected:
            raise ValueError(
                f"{folder / WEIGHTS_FILE}: {layer} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the model and r = {config.rank} need {expected[0]} and "
                f"{expected[1]}"
            )
        pieces.setdefault(path, []).append((shard, a, b * config.scale))
    reference = next(model.parameters())
    updates = {
        path: _stacked(_linear(model, path), found, reference) for path, found in pieces.items()
    }
    return Adapter(name=name, rank=config.rank, updates=updates)


def _shapes(
    module: nn.Linear, shard: str | int | None, rank: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of lora_A and lora_B for a layer (a shard of `module`) at rank `rank`."""
    return (rank, module.in_features), (_shard_rows(module, shard)[1], rank)


def _linear(model: CausalLM, path: str) -> nn.Linear:
    module = model.get_submodule(path)
    assert isinstance(module, nn.Linear), path
    return module


def _shard_rows(module: nn.Linear, shard: str | int | None) -> tuple[int, int]:
    """(offset, size) of a shard's output rows; the whole output when not fused."""
    if shard is None:
        return 0, module.out_features
    assert isinstance(module, FusedLinear)
    return module.shards[shard]


def _check_targets(path: Path, targets: tuple[str, ...] | str, layers: Mapping[str, Any]) -> None:
    """Every target names at least one linear layer of the model."""
    each = [(targets, targets)] if isinstance(targets, str) else [(t, (t,)) for t in targets]
    for label, target in each:
        if not any(targeted(name, target) for name in layers):
            leaves = sorted({name.rpartition(".")[2] for name in layers})
            raise ValueError(
                f"{path}: target_modules {label!r} matches no linear layer of the model "
                f"(its layers: {leaves})"
            )


def _read_pairs(path: Path, layers: Mapping[str, Layer]) -> dict[str, tuple[Any, Any]]:
    """lora_A and lora_B of every layer the file adapts, by PEFT layer name."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file (only safetensors adapter weights load)")
    sides: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt", device="cpu") as weights:
        for key in weights.keys():
            match = _WEIGHT_NAME.fullmatch(key)
            if match is None:
                raise ValueError(
                    f"{path}: unsupported weight {key!r} (only lora_A and lora_B of linear layers)"
                )
            layer = match["layer"]
            if layer not in layers:
                raise ValueError(f"{path}: {key!r} adapts {layer!r}, not a linear layer here")
            sides.setdefault(layer, {})[match["side"]] = weights.get_tensor(key).float()
    if not sides:
        raise ValueError(f"{path}: holds no LoRA weights")
    for layer, found in sides.items():
        if set(found) != {"A", "B"}:
            raise ValueError(f"{path}: {layer} has lora_{''.join(found)} without its pair")
    return {layer: (found["A"], found["B"]) for layer, found in sides.items()}


def _stacked(
    module: nn.Linear, pieces: list[Piece], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) for a module, on the device and in the dtype of `like`: the shards' A stacked,
    their B placed block-diagonally in the rows of their shard, so one pair of matrix products
    updates the whole fused output."""
    a = torch.cat([piece_a for _, piece_a, _ in pieces])
    b = torch.zeros(module.out_features, a.shape[0])
    column = 0
    for shard, piece_a, piece_b in pieces:
        offset, size = _shard_rows(module, shard)
        b[offset : offset + size, column : column + piece_a.shape[0]] = piece_b
        column += piece_a.shape[0]
    return a.to(like.device, like.dtype), b.to(like.device, like.dtype)


class AdapterSelection:
    """Which tokens of the pass being run use which adapter: (adapter slot, token rows, or None
    for every token). Set by the driver before the model runs, read by every wrapped layer."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []


class LoraLinear(SplitOutput):
    """A linear layer (plain, fused or int8) plus, for each token, its adapter's update
    B (A x), computed for each group of tokens that share an adapter."""

    def __init__(self, base: nn.Linear, selection: AdapterSelection) -> None:
        super().__init__()
        self.base: nn.Module = base
        self.selection = selection
        self.in_features = base.in_features
        self.out_features = base.out_features
        # Only a fused projection's wrapper is ever split.
        self.split_sizes = list(getattr(base, "split_sizes", []))
        self.slots: set[int] = set()

    def add(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """The update of the adapter in `slot`: A [R, in] and B [out, R], the scale in B. Kept
        as buffers, so that the model's size counts them and moving the model moves them."""
        self.register_buffer(f"lora_a{slot}", a, persistent=False)
        self.register_buffer(f"lora_b{slot}", b, persistent=False)
        self.slots.add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        for slot, rows in self.selection.groups:
            if slot not in self.slots:
                continue
            a, b = self.get_buffer(f"lora_a{slot}"), self.get_buffer(f"lora_b{slot}")
            if rows is None:
                out += (x @ a.T) @ b.T
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return out


class LoraAdapters:
    """The adapters applied to one model: its adapted layers wrapped once (before any int8
    conversion, which then converts the wrapped base layer), each adapter in a slot from 1."""

    def __init__(self, model: CausalLM, adapters: Sequence[Adapter]) -> None:
        self.names = tuple(adapter.name for adapter in adapters)
        self.ranks = {adapter.name: adapter.rank for adapter in adapters}
        self._slots = {name: slot for slot, name in enumerate(self.names, start=1)}
        self.selection = AdapterSelection()
        self._device = next(model.parameters()).device
        wrapped: dict[str, LoraLinear] = {}
        for slot, adapter in enumerate(adapters, start=1):
            for path, update in adapter.updates.items():
                if path not in wrapped:
                    wrapped[path] = self._wrap(model, path)
                wrapped[path].add(slot, *update)

    def _wrap(self, model: CausalLM, path: str) -> LoraLinear:
        parent, _, leaf = path.rpartition(".")
        owner = model.get_submodule(parent)
        layer = LoraLinear(_linear(model, path), self.selection)
        setattr(owner, leaf, layer)
        return layer

    @contextlib.contextmanager
    def applied(self, batch: ForwardBatch) -> Iterator[None]:
        """The batch's adapters chosen token by token while the block runs."""
        self.selection.groups = self._groups(batch)
        try:
            yield
        finally:
            self.selection.groups = []

    def _groups(self, batch: ForwardBatch) -> list[tuple[int, torch.Tensor | None]]:
        rows: dict[int, list[int]] = {}
        for r, name in enumerate(batch.adapters):
            if name is not None:
                start, end = batch.qo_indptr[r], batch.qo_indptr[r + 1]
                rows.setdefault(self._slots[name], []).extend(range(start, end))
        if len(rows) == 1 and len(next(iter(rows.values()))) == batch.num_tokens:
            return [(next(iter(rows)), None)]
        return [
            (slot, torch.tensor(tokens, dtype=torch.long, device=self._device))
            for slot, tokens in rows.items()
        ]


def load_adapters(
    model: CausalLM, paths: Mapping[str, str | Path], *, max_adapters: int, rank_budget: int
) -> LoraAdapters:
    """Every adapter of `paths` (name -> PEFT folder) loaded, checked and applied to `model`."""
    if len(paths) > max_adapters:
        raise ValueError(
            f"{len(paths)} adapters configured; [model] max_adapters allows {max_adapters}"
        )
    adapters = [load_adapter(name, path, model) for name, path in paths.items()]
    total = sum(adapter.rank for adapter in adapters)
    if total > rank_budget:
        raise ValueError(
            f"the adapters' ranks add up to {total}; [model] adapter_rank_budget allows "
            f"{rank_budget}"
        )
    return LoraAdapters(model, adapters)
