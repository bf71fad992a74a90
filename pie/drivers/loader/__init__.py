"""Load a model by spec: resolve it to an HF-style folder, build the architecture, fill its
weights and open its tokenizer."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.loader.resolve import DEFAULT_MODEL, resolve_model
from pie.drivers.loader.safetensors import load_safetensors
from pie.drivers.models import CausalLM, ModelConfig, build_model
from pie.drivers.models.media import MediaTowers
from pie.drivers.tokenizer import Tokenizer

__all__ = ["LoadedModel", "fill_weights", "load_model", "open_model", "resolve_model"]


@frozen(kw_only=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: CausalLM
    """In eval mode, with weights on the requested device and dtype."""
    tokenizer: Tokenizer
    path: Path
    """The HF-style folder it was loaded from."""


def open_model(spec: str | None, dtype: torch.dtype, device: str) -> LoadedModel:
    """The model of `spec` built with its weights not yet filled (`fill_weights` fills them),
    so that a caller can supply some of them in another form first; and its tokenizer."""
    path = resolve_model(spec)
    config = model_config_from_hf(json.loads((path / "config.json").read_text()))
    return LoadedModel(
        name=_display_name(spec),
        config=config,
        model=build_model(config, dtype, device),
        tokenizer=Tokenizer.from_folder(path, config.eos_token_ids),
        path=path,
    )


def fill_weights(loaded: LoadedModel, skip: Collection[tuple[str, str | int | None]] = ()) -> None:
    """Copies the checkpoint's weights in and sets eval mode; the (parameter, shard) pairs in
    `skip` are neither read nor written: the caller supplies those layers itself."""
    load_safetensors(loaded.model, loaded.path, skip)
    if isinstance(loaded.model, MediaTowers):
        processor = _settings(loaded.path / "preprocessor_config.json")
        loaded.model.processor = {} if processor is None else processor
        loaded.model.video_processor = _settings(loaded.path / "video_preprocessor_config.json")
    loaded.model.eval()


def _settings(path: Path) -> dict[str, Any] | None:
    """A processor's settings file, None when the checkpoint has none."""
    if not path.is_file():
        return None
    settings: dict[str, Any] = json.loads(path.read_text())
    return settings


def load_model(spec: str | None, dtype: torch.dtype, device: str) -> LoadedModel:
    """spec: None or the default alias, a .gguf file, or an HF folder (see `resolve_model`)."""
    loaded = open_model(spec, dtype, device)
    fill_weights(loaded)
    return loaded


def _display_name(spec: str | None) -> str:
    if spec is None or spec == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(spec)
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name
