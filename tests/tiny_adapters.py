"""Random PEFT LoRA adapters for the tiny models (saved with peft's save_pretrained), and the
peft model that serves them all: the reference our per-token adapters are compared against."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model

EVERY_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS: dict[str, dict[str, Any]] = {
    "terse": dict(r=4, lora_alpha=8, target_modules=list(EVERY_LINEAR)),
    "verbose": dict(r=8, lora_alpha=4, target_modules=list(EVERY_LINEAR), use_rslora=True),
    "sparse": dict(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj", "up_proj"]),
}
"""Two adapters over every linear layer (r 4 and r 8, different alphas, one rank-stabilised)
and one over some shards of the fused q/k/v and gate/up projections only."""


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    # peft asks transformers a question transformers has deprecated; not ours to fix.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        yield


def save_tiny_adapter(base: torch.nn.Module, folder: Path, seed: int, **config: Any) -> None:
    """A random adapter of `base` (left untouched) written to `folder` by peft. lora_B starts
    at zero in peft; it is drawn at random here so that the update is not zero."""
    torch.manual_seed(seed)
    with _quiet_peft():
        model = get_peft_model(copy.deepcopy(base), LoraConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)


def save_tiny_adapters(base: torch.nn.Module, root: Path) -> dict[str, Path]:
    """Every adapter of ADAPTERS saved under `root`, by name."""
    folders = {}
    for seed, (name, config) in enumerate(ADAPTERS.items(), start=1):
        folders[name] = root / name
        save_tiny_adapter(base, folders[name], seed, **config)
    return folders


def peft_model(base: torch.nn.Module, folders: dict[str, Path]) -> PeftModel:
    """`base` (copied) with every adapter loaded by peft under its name."""
    (first, path), *rest = folders.items()
    with _quiet_peft():
        model = PeftModel.from_pretrained(copy.deepcopy(base), path, adapter_name=first)
        for name, folder in rest:
            model.load_adapter(folder, adapter_name=name)
    return model.eval()


def peft_logits(model: PeftModel, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids` through `adapter` (None: the base model)."""
    batch = torch.tensor([ids])
    with torch.inference_mode():
        if adapter is None:
            with model.disable_adapter():
                return model(batch).logits[0].float()
        model.set_adapter(adapter)
        return model(batch).logits[0].float()


def peft_greedy(model: PeftModel, adapter: str | None, ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `ids` through `adapter` (None: the base model)."""
    tokens = list(ids)
    for _ in range(n):
        tokens.append(int(peft_logits(model, adapter, tokens)[-1].argmax()))
    return tokens[len(ids) :]
