"""Load a model by spec: resolve it to an HF-style folder, build the architecture, fill its
weights and open its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from attrs import frozen

from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.loader.resolve import DEFAULT_MODEL, resolve_model
from pie.drivers.loader.safetensors import load_safetensors
from pie.drivers.models import CausalLM, ModelConfig, build_model
from pie.drivers.tokenizer import Tokenizer

__all__ = ["LoadedModel", "load_model", "resolve_model"]


@frozen(kw_only=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: CausalLM
    """In eval mode, with weights on the requested device and dtype."""
    tokenizer: Tokenizer
    path: Path
    """The HF-style folder it was loaded from."""


def load_model(spec: str | None, dtype: torch.dtype, device: str) -> LoadedModel:
    """spec: None or the default alias, a .gguf file, or an HF folder (see `resolve_model`)."""
    path = resolve_model(spec)
    config = model_config_from_hf(json.loads((path / "config.json").read_text()))
    model = build_model(config, dtype, device)
    load_safetensors(model, path)
    model.eval()
    return LoadedModel(
        name=_display_name(spec),
        config=config,
        model=model,
        tokenizer=Tokenizer.from_folder(path, config.eos_token_ids),
        path=path,
    )


def _display_name(spec: str | None) -> str:
    if spec is None or spec == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(spec)
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name
