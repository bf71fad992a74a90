"""Qwen2-Audio: a Whisper-style audio encoder, average-pooled and projected into a Qwen2 text
model; each clip enters a prompt as <|audio_bos|>, one soft token per pooled frame,
<|audio_eos|>."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from attrs import frozen
from numpy.typing import NDArray
from torch import nn

from pie.drivers.models.base import AttentionFn, ModelConfig, register
from pie.drivers.models.llama import LlamaModel
from pie.drivers.models.media import (
    MediaRows,
    MediaTowers,
    PreparedMedia,
    SoftPiece,
    TextPiece,
    sequential_index,
)
from pie.drivers.models.qwen2 import Qwen2ForCausalLM
from pie.media.whisper_features import WhisperFeatures, log_mel

FAMILY = "qwen2_audio"
AUDIO_BOS = "<|audio_bos|>"
AUDIO_EOS = "<|audio_eos|>"
"""The delimiters transformers' Qwen2AudioProcessor expects around each clip's tokens."""
AUDIO_TOKEN_INDEX = 151646
"""Qwen2AudioConfig's default `audio_token_index` (<|AUDIO|>), the soft tokens' id."""
# Qwen2Config's values for the keys pie reads, which the released checkpoints' text_config
# leaves out (it states only what differs from them).
QWEN2_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
}


@frozen(kw_only=True)
class AudioEncoderConfig:
    """The audio tower's shape, read from config.json's `audio_config` with the defaults of
    transformers' Qwen2AudioEncoderConfig."""

    num_mel_bins: int = 128
    d_model: int = 1280
    layers: int = 32
    heads: int = 20
    ffn_dim: int = 5120
    max_source_positions: int = 1500

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> AudioEncoderConfig:
        d = cls()
        return cls(
            num_mel_bins=int(raw.get("num_mel_bins", d.num_mel_bins)),
            d_model=int(raw.get("d_model", d.d_model)),
            layers=int(raw.get("encoder_layers", d.layers)),
            heads=int(raw.get("encoder_attention_heads", d.heads)),
            ffn_dim=int(raw.get("encoder_ffn_dim", d.ffn_dim)),
            max_source_positions=int(raw.get("max_source_positions", d.max_source_positions)),
        )

    @property
    def window_frames(self) -> int:
        """Log-mel frames the encoder reads (two per position: conv2 has stride 2)."""
        return 2 * self.max_source_positions


def conv_lengths(frames: torch.Tensor) -> torch.Tensor:
    """Encoder positions (conv2 outputs) that cover a clip of `frames` log-mel frames."""
    return (frames - 1) // 2 + 1


def soft_token_count(frames: int) -> int:
    """Soft tokens of a clip of `frames` frames: its encoder positions, pooled in pairs."""
    return (int(conv_lengths(torch.tensor(frames))) - 2) // 2 + 1


class AudioAttention(nn.Module):
    """Bidirectional multi-head attention; k has no bias, as in Whisper."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, D]; keep [B, 1, 1, T] bool (False: a key past the clip) or None (all)."""
        b, t, _ = x.shape
        # q is scaled before the product, the reference's order of rounding.
        q = self._heads(self.q_proj(x) * self.scale)
        k, v = self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)


class AudioEncoderLayer(nn.Module):
    """Pre-LayerNorm residual block: attention, then a GELU MLP."""

    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        self.self_attn = AudioAttention(config.d_model, config.heads)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), keep)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """Two GELU convolutions (the second halving the frames), learned positions, the layers,
    pairs of positions averaged, and a final LayerNorm."""

    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        dim = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, dim)
        self.layers = nn.ModuleList(AudioEncoderLayer(config) for _ in range(config.layers))
        self.layer_norm = nn.LayerNorm(dim)

    def forward(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """features [B, mel, window] (whole windows), frames [B] (those holding audio) ->
        [B, P, D], where row i of a clip is its soft token i for i below its count.

        Attention sees only the positions that cover a clip, as the reference's key mask
        does over the whole window; the reference's rows past them are discarded, and no
        row kept reads them (convolutions reach one frame past a position's own frames,
        pooling pairs positions within the clip), so the window is cut after the longest
        clip of the batch: an equal result for a fraction of the work on short clips."""
        lengths = conv_lengths(frames.to(features.device))
        span = int(lengths.max())
        x = F.gelu(self.conv1(features[..., : 2 * span + 1]))
        x = F.gelu(self.conv2(x))[..., :span].transpose(1, 2)
        x = x + self.embed_positions.weight[:span]
        keep = None
        if bool((lengths < span).any()):
            keep = (torch.arange(span, device=x.device) < lengths[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keep)
        x = F.avg_pool1d(x.transpose(1, 2), kernel_size=2, stride=2).transpose(1, 2)
        return self.layer_norm(x)


class AudioProjector(nn.Module):
    """Encoder width to the text model's hidden size."""

    def __init__(self, audio_dim: int, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(audio_dim, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioTextModel(LlamaModel):
    """The Qwen2 stack, with soft-token rows replacing token embeddings in a pass."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        media: MediaRows | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if media is not None:
            hidden = media.into(hidden)
        return self.decode(hidden, positions, attention)


@register(FAMILY)
class Qwen2AudioForConditionalGeneration(Qwen2ForCausalLM, MediaTowers):
    """Qwen2 reading audio clips of up to one encoder window (30 s for the released
    checkpoints). A longer clip is refused rather than cut to the window as transformers'
    processor does, so no audio is dropped without the caller knowing."""

    modalities = frozenset({"audio"})
    chat_placeholders = {"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"}
    hf_defaults = QWEN2_TEXT_DEFAULTS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.audio_config = AudioEncoderConfig.from_hf(config.raw.get("audio_config") or {})
        self.audio_token_id = int(config.raw.get("audio_token_index", AUDIO_TOKEN_INDEX))
        self.audio_tower = AudioEncoder(self.audio_config)
        self.multi_modal_projector = AudioProjector(self.audio_config.d_model, config.hidden_size)

    def body(self, config: ModelConfig) -> nn.Module:
        return Qwen2AudioTextModel(config, self.attention_cls)

    @classmethod
    def flat_hf_config(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, **(raw.get("text_config") or {}), "model_type": raw["model_type"]}

    @classmethod
    def check_hf_config(cls, raw: dict[str, Any]) -> None:
        super().check_hf_config(raw)
        act = (raw.get("audio_config") or {}).get("activation_function", "gelu")
        if act != "gelu":
            raise ValueError(f"{FAMILY}: unsupported audio activation_function {act!r}")

    def route_weight(self, name: str) -> tuple[str, str | int | None] | None:
        """The checkpoint keeps the text model under `language_model.`; the audio tower's
        q/k/v stay separate, out of reach of the text model's fused-projection mapping."""
        if name.startswith(("audio_tower.", "multi_modal_projector.")):
            return name, None
        text = name.removeprefix("language_model.")
        for fragment, (fused, shard) in self.packed_modules_mapping.items():
            if f".{fragment}." in text:
                return text.replace(f".{fragment}.", f".{fused}."), shard
        return text, None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        media: MediaRows | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attention, media)

    @property
    def audio_rate(self) -> int:
        return int(self._features().sampling_rate)

    def prepare(
        self, kind: str, decoded: Any, tokenize: Callable[[str], Sequence[int]]
    ) -> PreparedMedia:
        """A clip's log-mel features over the whole window and its span; ValueError for
        media other than audio, another sampling rate, an empty clip or one longer than
        the window."""
        if kind not in self.modalities:
            raise ValueError(f"{FAMILY} reads audio only, not {kind}")
        settings = self._features()
        samples = np.asarray(decoded.samples, dtype=np.float32)
        _check_clip(samples, decoded.rate, settings)
        features, frames = log_mel(samples, settings)
        count = soft_token_count(frames)
        if count < 1:
            raise ValueError(f"{FAMILY}: a clip of {len(samples)} samples is too short")
        span = (
            _delimiter(tokenize, AUDIO_BOS),
            SoftPiece(placeholder=self.audio_token_id, rope_index=sequential_index(count)),
            _delimiter(tokenize, AUDIO_EOS),
        )
        inputs = {"features": torch.from_numpy(features), "frames": torch.tensor(frames)}
        return PreparedMedia(kind="audio", inputs=inputs, span=span, grid=(1, 1, count))

    def encode(self, items: Sequence[PreparedMedia]) -> list[torch.Tensor]:
        """All clips in one batch: every item's features span the same window."""
        if not items:
            return []
        weight = self.multi_modal_projector.linear.weight
        features = torch.stack([item.inputs["features"] for item in items])
        frames = torch.stack([item.inputs["frames"] for item in items])
        hidden = self.audio_tower(features.to(weight.device, weight.dtype), frames)
        embeds = self.multi_modal_projector(hidden)
        return [embeds[i, : item.soft_count] for i, item in enumerate(items)]

    def _features(self) -> WhisperFeatures:
        settings = WhisperFeatures.from_preprocessor_config(self.processor)
        wanted = (self.audio_config.num_mel_bins, self.audio_config.window_frames)
        if (settings.feature_size, settings.frames) != wanted:
            raise ValueError(
                f"{FAMILY}: preprocessor_config.json gives {settings.feature_size} mel bins "
                f"by {settings.frames} frames; the encoder reads {wanted[0]} by {wanted[1]}"
            )
        return settings


def _check_clip(samples: NDArray[np.float32], rate: int, settings: WhisperFeatures) -> None:
    if rate != settings.sampling_rate:
        raise ValueError(
            f"{FAMILY}: audio must be at {settings.sampling_rate} samples a second, got {rate}"
        )
    if len(samples) > settings.n_samples:
        raise ValueError(
            f"{FAMILY}: a clip of {len(samples) / rate:.3f} s is longer than the encoder's "
            f"window of {settings.chunk_length} s"
        )


def _delimiter(tokenize: Callable[[str], Sequence[int]], text: str) -> TextPiece:
    tokens = tuple(tokenize(text))
    if len(tokens) != 1:
        raise ValueError(f"{FAMILY}: the tokenizer has no single token for {text}")
    # TextPiece's `converter=tuple` leaves mypy an unsolved Iterable[_T_co] to match.
    return TextPiece(tokens=tokens)
