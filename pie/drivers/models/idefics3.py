"""Idefics3 and SmolVLM: a SigLIP-style vision encoder over square image crops, a pixel-shuffle
connector projecting each crop's patches into the Llama text model, whose token embeddings the
crops' soft tokens replace."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pie.drivers.models.base import AttentionFn, ModelConfig, register
from pie.drivers.models.layers import qkv_projection
from pie.drivers.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from pie.drivers.models.media import (
    MediaRows,
    MediaTowers,
    Piece,
    PreparedMedia,
    SoftPiece,
    TextPiece,
    sequential_index,
)
from pie.media.idefics3 import IMAGE_TOKEN, Idefics3Vision, image_prompt, preprocess_image

FAMILY = "Idefics3/SmolVLM"
VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1152,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_channels=3,
    image_size=224,
    patch_size=32,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)
"""transformers' Idefics3VisionConfig defaults, for keys a config.json leaves out."""
GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def vision_settings(raw: dict[str, Any]) -> dict[str, Any]:
    return {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}


class VisionEmbeddings(nn.Module):
    """Patches by a strided convolution plus learned positions: a crop's patch grid is spread
    over the table's grid by fractional coordinates, so a smaller grid reads a subset."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        hidden, patch = vision["hidden_size"], vision["patch_size"]
        self.per_side = vision["image_size"] // patch
        self.patch_embedding = nn.Conv2d(vision["num_channels"], hidden, patch, stride=patch)
        self.position_embedding = nn.Embedding(self.per_side**2, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, C, H, W] -> [B, patches, hidden], patches row by row."""
        patches = self.patch_embedding(pixels)
        ids = patch_position_ids(patches.shape[2], patches.shape[3], self.per_side)
        return patches.flatten(2).transpose(1, 2) + self.position_embedding(ids.to(pixels.device))


def patch_position_ids(grid_h: int, grid_w: int, per_side: int) -> torch.Tensor:
    """[grid_h * grid_w] indices into a per_side x per_side table: each patch's fractional
    coordinate (index / grid) bucketed by the table's boundaries, in float32 as the reference."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, dtype=torch.float32)

    def buckets(n: int) -> torch.Tensor:
        coords = torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(n))
        return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)

    return (buckets(grid_h)[:, None] * per_side + buckets(grid_w)[None, :]).flatten()


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one crop's patches."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        hidden = vision["hidden_size"]
        self.num_heads = vision["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = qkv_projection(
            hidden, self.num_heads, self.num_heads, self.head_dim, bias=True
        )
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden.shape
        q, k, v = (
            x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
            for x in self.qkv_proj.forward_split(hidden)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))


class VisionMLP(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        self.approximate = GELU_APPROXIMATION[vision["hidden_act"]]
        self.fc1 = nn.Linear(vision["hidden_size"], vision["intermediate_size"])
        self.fc2 = nn.Linear(vision["intermediate_size"], vision["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class VisionEncoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP, each after a LayerNorm."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = vision["hidden_size"], vision["layer_norm_eps"]
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(vision)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = VisionMLP(vision)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class VisionEncoder(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(vision) for _ in range(vision["num_hidden_layers"])
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class VisionTransformer(nn.Module):
    """Crops [B, C, S, S] -> patch states [B, (S / patch)^2, vision hidden]."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(vision)
        self.encoder = VisionEncoder(vision)
        self.post_layernorm = nn.LayerNorm(vision["hidden_size"], eps=vision["layer_norm_eps"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixels)))


class Connector(nn.Module):
    """Each scale x scale block of neighbouring patches concatenated into one vector (pixel
    shuffle), then projected to the text model's width: one soft token per block."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.ModuleDict(
            {"proj": nn.Linear(vision_hidden * scale**2, text_hidden, bias=False)}
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, side^2, E] (a square grid) -> [B, (side / scale)^2, text hidden]; a block's
        vector holds its patches row by row."""
        batch, count, width = patches.shape
        side, s = int(count**0.5), self.scale
        blocks = patches.view(batch, side // s, s, side // s, s, width).permute(0, 1, 3, 2, 4, 5)
        return self.modality_projection["proj"](blocks.reshape(batch, -1, s * s * width))


class Idefics3Body(nn.Module):
    """The checkpoint's `model`: the Llama text model, the vision encoder and the connector."""

    def __init__(self, config: ModelConfig, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        vision = vision_settings(config.raw)
        self.text_model = LlamaModel(config, attention_cls)
        self.vision_model = VisionTransformer(vision)
        self.connector = Connector(
            vision["hidden_size"], config.hidden_size, config.raw.get("scale_factor", 2)
        )

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The text model's embeddings, where LlamaForCausalLM looks to tie its head."""
        embeddings = self.text_model.embed_tokens
        assert isinstance(embeddings, nn.Embedding)
        return embeddings


@register("idefics3", "smolvlm")
class Idefics3ForConditionalGeneration(LlamaForCausalLM, MediaTowers):
    modalities = frozenset({"image"})
    chat_placeholders = {"image": "<image>"}

    @classmethod
    def flat_hf_config(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The text config's keys on top; the model type and the head's tying stay the outer
        config's (transformers ties by the outer `tie_word_embeddings`, default false)."""
        return {
            **raw,
            **(raw.get("text_config") or {}),
            "model_type": raw["model_type"],
            "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        }

    @classmethod
    def check_hf_config(cls, raw: dict[str, Any]) -> None:
        super().check_hf_config(raw)
        text_type = (raw.get("text_config") or {}).get("model_type", "llama")
        if text_type != "llama":
            raise ValueError(f"{FAMILY}: unsupported text model {text_type!r}; only 'llama'")
        act = vision_settings(raw)["hidden_act"]
        if act not in GELU_APPROXIMATION:
            raise ValueError(f"{FAMILY}: unsupported vision hidden_act {act!r}")

    def body(self, config: ModelConfig) -> nn.Module:
        return Idefics3Body(config, self.attention_cls)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        media: MediaRows | None = None,
    ) -> torch.Tensor:
        text = self.towers.text_model
        hidden = text.embed_tokens(input_ids)
        if media is not None:
            hidden = media.into(hidden)
        return text.decode(hidden, positions, attention)

    def prepare(
        self, kind: str, decoded: Any, tokenize: Callable[[str], Sequence[int]]
    ) -> PreparedMedia:
        if kind not in self.modalities:
            raise ValueError(f"{FAMILY} models read images only, not {kind!r}")
        settings = Idefics3Vision.from_preprocessor_config(self.processor)
        side = self._soft_side(settings.crop_size)
        try:
            crops = preprocess_image(decoded.pixels, settings)
        except ValueError as e:
            raise ValueError(f"{FAMILY}: {e}") from None
        span = self._span(image_prompt(crops.rows, crops.cols, IMAGE_TOKEN), side**2, tokenize)
        if sum(isinstance(p, SoftPiece) for p in span) != crops.count:
            raise ValueError(
                f"{FAMILY}: the tokenizer does not encode {IMAGE_TOKEN!r} as the config's "
                f"image_token_id {self._image_token_id}"
            )
        return PreparedMedia(
            kind=kind,
            inputs={"pixel_values": torch.from_numpy(crops.pixel_values)},
            span=span,
            grid=(crops.count, side, side),
        )

    def encode(self, items: Sequence[PreparedMedia]) -> list[torch.Tensor]:
        """Every item's crops through the encoder as one batch (all crops share one size)."""
        if not items:
            return []
        towers = self.towers
        pixels = torch.cat([item.inputs["pixel_values"] for item in items])
        soft = towers.connector(towers.vision_model(pixels.to(self.lm_head.weight)))
        counts = [item.inputs["pixel_values"].shape[0] for item in items]
        return [crops.flatten(0, 1) for crops in soft.split(counts)]

    @property
    def towers(self) -> Idefics3Body:
        assert isinstance(self.model, Idefics3Body)
        return self.model

    @property
    def _image_token_id(self) -> int:
        return int(self.config.raw.get("image_token_id", 128257))

    def _soft_side(self, crop_size: int) -> int:
        """Soft tokens along each side of a crop; ValueError when the crop does not divide."""
        vision = vision_settings(self.config.raw)
        block = vision["patch_size"] * self.towers.connector.scale
        if crop_size % block:
            raise ValueError(
                f"{FAMILY}: crop size {crop_size} is not a multiple of patch_size x "
                f"scale_factor = {block}"
            )
        return crop_size // block

    def _span(
        self, prompt: str, per_crop: int, tokenize: Callable[[str], Sequence[int]]
    ) -> tuple[Piece, ...]:
        """The prompt encoded whole, so the text between crops merges as in the full prompt,
        then each image token (one per crop) widened into the crop's soft tokens."""
        placeholder = self._image_token_id
        pieces: list[Piece] = []
        text: list[int] = []
        for token in tokenize(prompt):
            if token != placeholder:
                text.append(token)
                continue
            if text:
                pieces.append(TextPiece(tokens=text))
                text = []
            pieces.append(SoftPiece(placeholder=placeholder, rope_index=sequential_index(per_crop)))
        if text:
            pieces.append(TextPiece(tokens=text))
        return tuple(pieces)
