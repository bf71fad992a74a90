"""Small random Qwen2-VL and Qwen2-Audio checkpoints for `pie bench media`, written once per size
by transformers (`from_config` + `save_pretrained`) with the default model's tokenizer and kept
in the cache (no real vision or audio checkpoint ships with pie)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attrs import frozen

SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
AUDIO_SPECIAL = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
VL_PROCESSOR: dict[str, Any] = {
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
"""Qwen2-VL's released image processor settings (its patch size is the model's)."""
MEL_BINS = 128
END_OF_TEXT = "<|endoftext|>"


@frozen(kw_only=True)
class MediaModelSize:
    """The shape of both random models: a Qwen2 decoder of `hidden` x `layers` (heads of 64,
    MLP 4x), a vision tower of `vision_dim` x `vision_depth` with `patch`-pixel patches merged
    2x2, and an audio encoder of the vision tower's width and depth."""

    hidden: int = 256
    layers: int = 4
    vision_dim: int = 256
    vision_depth: int = 4
    patch: int = 14

    def describe(self) -> str:
        return (
            f"decoder hidden {self.hidden} x {self.layers} layers, vision {self.vision_dim} x "
            f"{self.vision_depth} blocks (patch {self.patch}, merge 2), audio encoder "
            f"{self.vision_dim} x {self.vision_depth} layers, float32"
        )

    @property
    def tag(self) -> str:
        return f"h{self.hidden}-l{self.layers}-v{self.vision_dim}x{self.vision_depth}-p{self.patch}"


def vl_checkpoint(size: MediaModelSize, cache: Path) -> Path:
    """The random Qwen2-VL of `size` under `cache`, written on first use."""
    return _cached(cache / f"qwen2_vl-{size.tag}", lambda folder: _write_vl(size, folder))


def audio_checkpoint(size: MediaModelSize, cache: Path) -> Path:
    """The random Qwen2-Audio of `size` under `cache`, written on first use."""
    return _cached(cache / f"qwen2_audio-{size.tag}", lambda folder: _write_audio(size, folder))


def _cached(folder: Path, write: Callable[[Path], None]) -> Path:
    """`folder`, written through a scratch folder renamed into place, so that an interrupted
    write leaves nothing a later run would take for a checkpoint."""
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        write(scratch)
        scratch.rename(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def _tokenizer(folder: Path, special: list[str]) -> dict[str, int]:
    """The default model's tokenizer with `special` added, saved in `folder`; their ids."""
    from transformers import PreTrainedTokenizerFast

    from pie.drivers.loader import resolve_model

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(resolve_model(None)))
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.save_pretrained(str(folder))
    named = [END_OF_TEXT, *special]
    return {token: int(tokenizer.convert_tokens_to_ids(token)) for token in named}


def _text_config(size: MediaModelSize, ids: dict[str, int]) -> dict[str, Any]:
    return {
        "model_type": "qwen2",
        "hidden_size": size.hidden,
        "intermediate_size": 4 * size.hidden,
        "num_hidden_layers": size.layers,
        "num_attention_heads": _heads(size.hidden),
        "num_key_value_heads": max(1, _heads(size.hidden) // 2),
        "vocab_size": max(ids.values()) + 1,
        "bos_token_id": ids[END_OF_TEXT],
        "eos_token_id": ids[END_OF_TEXT],
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }


def _mrope(size: MediaModelSize) -> dict[str, Any]:
    """Qwen2-VL's split of a head's frequencies over t, h and w (16, 24, 24 of 64), rescaled."""
    half = size.hidden // _heads(size.hidden) // 2
    t = half // 4
    h = (half - t) // 2
    return {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [t, h, half - t - h]}


def _heads(width: int) -> int:
    return max(1, width // 64)


def _write_vl(size: MediaModelSize, folder: Path) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = _tokenizer(folder, SPECIAL)
    config = Qwen2VLConfig(
        text_config={
            **_text_config(size, ids),
            "tie_word_embeddings": True,
            "rope_parameters": _mrope(size),
        },
        vision_config={
            "depth": size.vision_depth,
            "embed_dim": size.vision_dim,
            "hidden_size": size.hidden,
            "num_heads": _heads(size.vision_dim),
            "patch_size": size.patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        tie_word_embeddings=True,
    )
    _save_random(Qwen2VLForConditionalGeneration, config, folder)
    processor = {**VL_PROCESSOR, "patch_size": size.patch}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))


def _write_audio(size: MediaModelSize, folder: Path) -> None:
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    ids = _tokenizer(folder, SPECIAL + AUDIO_SPECIAL)
    config = Qwen2AudioConfig(
        text_config=_text_config(size, ids),
        audio_config={
            "model_type": "qwen2_audio_encoder",
            "d_model": size.vision_dim,
            "encoder_layers": size.vision_depth,
            "encoder_attention_heads": _heads(size.vision_dim),
            "encoder_ffn_dim": 4 * size.vision_dim,
            "num_mel_bins": MEL_BINS,
            "max_source_positions": 1500,
        },
        audio_token_index=ids["<|AUDIO|>"],
    )
    _save_random(Qwen2AudioForConditionalGeneration, config, folder)
    WhisperFeatureExtractor(feature_size=MEL_BINS).save_pretrained(str(folder))


def _save_random(model_class: Any, config: Any, folder: Path) -> None:
    """The model with transformers' own initial weights, seeded so that a size is one model."""
    import torch

    torch.manual_seed(0)
    model_class(config).save_pretrained(str(folder))
