"""Qwen2-VL and Qwen2.5-VL: the Qwen2 decoder with multimodal rotary positions (M-RoPE), whose
vision tower turns images and videos into soft tokens placed between vision start and end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from pie.drivers.models.base import AttentionFn, ModelConfig, register
from pie.drivers.models.layers import RotaryEmbedding
from pie.drivers.models.llama import LlamaModel
from pie.drivers.models.media import MediaRows, MediaTowers, PreparedMedia, SoftPiece, TextPiece
from pie.drivers.models.qwen2 import Qwen2Attention, Qwen2ForCausalLM
from pie.drivers.models.qwen2_vl_vision import VisionConfig, VisionTower
from pie.media.errors import MediaError
from pie.media.qwen2_vl import Qwen2VLVision, VisionPatches, preprocess_image, preprocess_video

DEFAULT_MROPE_SECTION = (16, 24, 24)


def mrope_section(config: ModelConfig) -> tuple[int, ...]:
    """How many of a head's rotary frequencies follow the t, h and w streams, in that order."""
    raw = config.raw
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    section = tuple(rope.get("mrope_section", DEFAULT_MROPE_SECTION))
    if sum(section) != config.head_dim // 2:
        raise ValueError(
            f"{config.model_type}: mrope_section {list(section)} must add up to half the head "
            f"dimension ({config.head_dim // 2})"
        )
    return section


class PassRotary(RotaryEmbedding):
    """Rotary tables with one row per token of a pass: M-RoPE mixes three position streams
    within each token's row, so no table indexed by a single position holds it. A pass reads
    them at rows 0..T-1, through whichever layer kernels the model runs on."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        nn.Module.__init__(self)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


class MRopeTextModel(LlamaModel):
    """The Qwen2 decoder whose soft-token rows take encoder embeddings and rotate by their
    (t, h, w) streams; every other token's three streams are its position."""

    stream_of_frequency: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        # Legacy "mrope" scaling is plain rope over each stream.
        super().__init__(attrs.evolve(config, rope_scaling=None), Qwen2Attention)
        section = mrope_section(config)
        streams = torch.cat(
            [torch.full((size,), i % 3, dtype=torch.int64) for i, size in enumerate(section)]
        )
        self.register_buffer("stream_of_frequency", streams, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        media: MediaRows | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if media is None:
            rope = self.kernels.rope(positions, self.rotary_emb)
        else:
            hidden = media.into(hidden)
            rows = torch.arange(positions.numel(), device=positions.device)
            rope = self.kernels.rope(rows, self.pass_rotary(positions, media))
        return self.run_layers(hidden, rope, attention)

    def rope_streams(self, positions: torch.Tensor, media: MediaRows) -> torch.Tensor:
        """[T, 3] (t, h, w) positions: a soft row's are its position - t + (t, h, w)."""
        streams = positions[:, None].repeat(1, 3)
        index = media.rope_index.to(positions.device)
        soft = positions[media.rows, None] - index[:, :1] + index
        return streams.index_copy_(0, media.rows, soft)

    def pass_rotary(self, positions: torch.Tensor, media: MediaRows) -> PassRotary:
        """Each token's cos and sin, every frequency read from its section's stream."""
        chosen = self.rope_streams(positions, media)[:, self.stream_of_frequency]
        frequency = torch.arange(chosen.shape[1], device=chosen.device)
        return PassRotary(
            self.rotary_emb.cos[chosen, frequency], self.rotary_emb.sin[chosen, frequency]
        )


def flatten_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with `text_config`'s keys at the top (transformers 5 nests them; older files
    are flat already); tied embeddings when either level says so, as transformers reads it."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    flat = {k: v for k, v in raw.items() if k != "text_config"}
    flat.update((k, v) for k, v in text.items() if k != "model_type")
    flat["tie_word_embeddings"] = bool(
        raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")
    )
    return flat


@register("qwen2_vl")
class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM, MediaTowers):
    modalities = frozenset({"image", "video"})
    chat_placeholders = {
        "image": "<|vision_start|><|image_pad|><|vision_end|>",
        "video": "<|vision_start|><|video_pad|><|vision_end|>",
    }
    rope_types = ("mrope",)
    hf_defaults = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6}
    vision_config_from: Callable[[dict[str, Any]], VisionConfig] = VisionConfig.qwen2_vl
    visual: VisionTower

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.visual = VisionTower(
            type(self).vision_config_from(config.raw.get("vision_config") or {})
        )
        raw = config.raw
        self.vision_start = int(raw.get("vision_start_token_id", 151652))
        self.vision_end = int(raw.get("vision_end_token_id", 151653))
        self.placeholder = {
            "image": int(raw.get("image_token_id", 151655)),
            "video": int(raw.get("video_token_id", 151656)),
        }

    def body(self, config: ModelConfig) -> nn.Module:
        return MRopeTextModel(config)

    @classmethod
    def flat_hf_config(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return flatten_text_config(raw)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        media: MediaRows | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attention, media)

    def prepare(
        self, kind: str, decoded: Any, tokenize: Callable[[str], Sequence[int]]
    ) -> PreparedMedia:
        """Its delimiters are token ids of the config, so `tokenize` is not needed."""
        family = self.config.model_type
        if kind not in self.modalities:
            raise ValueError(f"{family} reads {sorted(self.modalities)}, not {kind!r}")
        try:
            patches = self.patches(kind, decoded)
        except ValueError as e:
            raise MediaError(f"{family} cannot read this {kind}: {e}") from e
        t, h, w = patches.grid_thw
        merge = self.visual.config.merge_size
        grid = (t, h // merge, w // merge)
        soft = SoftPiece(
            placeholder=self.placeholder[kind], rope_index=self.rope_index(kind, grid, decoded)
        )
        return PreparedMedia(
            kind=kind,
            inputs={
                "pixel_values": torch.from_numpy(patches.pixel_values),
                "grid_thw": torch.tensor(patches.grid_thw),
            },
            span=(_delimiter(self.vision_start), soft, _delimiter(self.vision_end)),
            grid=grid,
        )

    def patches(self, kind: str, decoded: Any) -> VisionPatches:
        settings = self.vision_settings(kind)
        if kind == "image":
            return preprocess_image(decoded.pixels, settings)
        return preprocess_video([frame.pixels for frame in decoded.frames], settings)

    def vision_settings(self, kind: str = "image") -> Qwen2VLVision:
        """The processor's settings for `kind` (video: the video processor's, where the
        checkpoint has one); its patch sizes, where it states them, must be the tower's."""
        tower = self.visual.config
        sizes = {
            "patch_size": tower.patch_size,
            "temporal_patch_size": tower.temporal_patch_size,
            "merge_size": tower.merge_size,
        }
        video = kind == "video" and self.video_processor is not None
        given = self.video_processor if video else self.processor
        assert given is not None
        settings = Qwen2VLVision.from_preprocessor_config({**sizes, **given})
        mismatched = {k: v for k, v in sizes.items() if getattr(settings, k) != v}
        if mismatched:
            name = "video_preprocessor_config.json" if video else "preprocessor_config.json"
            raise ValueError(
                f"{self.config.model_type}: {name} disagrees with the vision "
                f"tower on {sorted(mismatched)} (tower: {mismatched})"
            )
        return settings

    def rope_index(self, kind: str, grid: tuple[int, int, int], decoded: Any) -> torch.Tensor:
        """[t * h * w, 3] (t, h, w) of each soft token, in the merger's order."""
        t, h, w = grid
        ts = self.time_index(t, decoded) if kind == "video" else torch.arange(t)
        tt, hh, ww = torch.meshgrid(ts, torch.arange(h), torch.arange(w), indexing="ij")
        return torch.stack([tt, hh, ww], dim=-1).reshape(-1, 3)

    def time_index(self, t: int, decoded: Any) -> torch.Tensor:
        """Qwen2-VL counts a video's frame pairs."""
        return torch.arange(t)

    def encode(self, items: Sequence[PreparedMedia]) -> list[torch.Tensor]:
        """All items through the tower in one call, each attending only within itself."""
        if not items:
            return []
        pixels = torch.cat([item.inputs["pixel_values"] for item in items])
        merged = self.visual(pixels, [_grid(item.inputs["grid_thw"]) for item in items])
        return list(merged.split([item.soft_count for item in items]))


def _delimiter(token: int) -> TextPiece:
    return TextPiece(tokens=(token,))


def _grid(grid_thw: torch.Tensor) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in grid_thw.tolist())
    return t, h, w


@register("qwen2_5_vl")
class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same decoder; a windowed, gated vision tower; a video's t index counts
    time (`tokens_per_second` of rope per second) rather than frame pairs."""

    vision_config_from = VisionConfig.qwen2_5_vl

    def time_index(self, t: int, decoded: Any) -> torch.Tensor:
        frames = decoded.frames
        spacing = (frames[-1].seconds - frames[0].seconds) / (len(frames) - 1) if t > 1 else 0.0
        vision = self.config.raw.get("vision_config") or {}
        per_pair = vision.get("tokens_per_second", 4) * self.visual.config.temporal_patch_size
        # float32 and truncation, as the reference computes it.
        interval = torch.tensor(per_pair * spacing, dtype=torch.float32)
        return (torch.arange(t) * interval).long()
