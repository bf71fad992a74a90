"""Copy the weights of an HF safetensors checkpoint (one file or an indexed set of shards) into a
model, routing separate q/k/v and gate/up weights into the model's fused projections, or copying
a projection the checkpoint stores fused already (Phi-3) whole."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from pie.drivers.models import CausalLM

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@runtime_checkable
class ShardedModule(Protocol):
    """A module whose parameters the checkpoint stores in pieces: a FusedLinear's projections,
    stacked experts' per-expert weights."""

    shards: Collection[str | int]

    def load_shard(
        self, param: nn.Parameter, weight: torch.Tensor, shard_id: str | int
    ) -> None: ...


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder, sharded or not."""
    index = folder / _INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / _SINGLE).is_file():
        return [folder / _SINGLE]
    raise FileNotFoundError(f"no {_SINGLE} or {_INDEX} in {folder}")


def load_safetensors(
    model: CausalLM, folder: Path, skip: Collection[tuple[str, str | int | None]] = ()
) -> None:
    """Fill every parameter of model from folder, except the (parameter, shard) pairs in `skip`,
    which are not even read; ValueError lists missing or unexpected ones."""
    params = dict(model.named_parameters())
    loaded: set[tuple[str, str | int | None]] = set(skip)

    def wanted(name: str) -> bool:
        return not _is_ignored(name, model) and checkpoint_target(name, model) not in loaded

    unexpected: list[str] = []
    found = _wanted_tensors(checkpoint_files(folder), wanted)
    for name, tensor in _progress(_read_tensors(found), len(found), folder):
        target, shard = checkpoint_target(name, model)
        if target not in params:
            unexpected.append(name)
            continue
        _copy(model, target, params[target], tensor, shard)
        loaded.add((target, shard))
    missing = _missing(model, params, loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not match {type(model).__name__}: "
            f"missing {missing or 'none'}; unexpected {unexpected or 'none'}"
        )


def _wanted_tensors(files: list[Path], wanted: Callable[[str], bool]) -> list[tuple[Path, str]]:
    """(file, name) of each tensor to read, in file order."""
    found: list[tuple[Path, str]] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            found += [(path, name) for name in f.keys() if wanted(name)]
    return found


def _read_tensors(found: list[tuple[Path, str]]) -> Iterator[tuple[str, torch.Tensor]]:
    for path, name in found:
        # One mapping per tensor: the file's pages leave this process's resident memory as each
        # closes, instead of adding the whole file to the peak (465 MB measured on the default
        # model's float32 folder).
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield name, f.get_tensor(name)


def _progress(
    tensors: Iterator[tuple[str, torch.Tensor]], total: int, folder: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    # A bar for a terminal only: in a log file its redraws are noise.
    return tqdm(
        tensors,
        total=total,
        desc=f"pie: loading {folder.name}",
        unit=" tensors",
        leave=False,
        disable=None,
    )


def _is_ignored(name: str, model: CausalLM) -> bool:
    # Older checkpoints store rope inv_freq; ours are recomputed. A tied lm_head may be saved too.
    if name.endswith("rotary_emb.inv_freq") or model.ignores_weight(name):
        return True
    return name == "lm_head.weight" and model.config.tie_word_embeddings


def checkpoint_target(name: str, model: CausalLM) -> tuple[str, str | int | None]:
    """HF name -> (our parameter name, shard id or None when it is not fused). A model whose
    names a fragment mapping cannot express (per-expert weights) routes them in `route_weight`."""
    routed = model.route_weight(name)
    if routed is not None:
        return routed
    for fragment, (fused, shard) in model.packed_modules_mapping.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard
    return name, None


def _copy(
    model: nn.Module,
    target: str,
    param: nn.Parameter,
    tensor: torch.Tensor,
    shard: str | int | None,
) -> None:
    if shard is not None:
        module = model.get_submodule(target.rsplit(".", 1)[0])
        assert isinstance(module, ShardedModule), target
        try:
            module.load_shard(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"{target}: {e}") from None
        return
    if param.shape != tensor.shape:
        raise ValueError(
            f"{target}: expected shape {tuple(param.shape)}, checkpoint has {tuple(tensor.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)


def _missing(
    model: nn.Module, params: dict[str, nn.Parameter], loaded: set[tuple[str, str | int | None]]
) -> list[str]:
    missing = []
    for name in params:
        if (name, None) in loaded:  # whole, fused or not
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0])
        shards: list[str | int | None] = (
            list(module.shards) if isinstance(module, ShardedModule) else [None]
        )
        missing += [
            name if shard is None else f"{name}[{shard}]"
            for shard in shards
            if (name, shard) not in loaded
        ]
    return missing
