"""Model architectures by HF `model_type`, and construction of an empty model for a config."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pie.drivers.models import (  # noqa: F401  (importing registers them)
    csm,
    gemma2,
    gemma3,
    idefics3,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen2_audio,
    qwen2_vl,
    qwen3,
    qwen3_moe,
)
from pie.drivers.models.base import MODEL_REGISTRY, AttentionFn, CausalLM, ModelConfig

__all__ = ["MODEL_REGISTRY", "AttentionFn", "CausalLM", "ModelConfig", "build_model"]


def build_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """An uninitialised model of config's architecture, allocated directly on device in dtype."""
    try:
        model_cls = MODEL_REGISTRY[config.model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {config.model_type!r}; supported: {sorted(MODEL_REGISTRY)}"
        ) from None
    previous = torch.get_default_dtype()
    # Allocating in the target dtype and device avoids a float32 copy of a large model on the host.
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _no_initialisation():
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model


@contextmanager
def _no_initialisation() -> Iterator[None]:
    """Linear and embedding weights left as allocated: the loader fills them, and random
    initialisation would write every byte, making the whole float model resident (550 MB for
    the default model) even where its layers are then taken in another form (int4)."""
    classes: tuple[type[Any], ...] = (nn.Linear, nn.Embedding)
    saved = {cls: cls.reset_parameters for cls in classes}
    for cls in classes:
        cls.reset_parameters = _leave
    try:
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method


def _leave(_: nn.Module) -> None:
    return None
