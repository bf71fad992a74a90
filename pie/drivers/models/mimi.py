"""The decoding half of the Mimi audio codec, as CSM checkpoints carry it (`codec_model.*`): codes
[frames, codebooks] through the residual quantizer's codebooks to latents, the upsampling
transposed convolution, the decoder transformer and the SEANet convolutional decoder to samples."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from attrs import field, frozen
from torch import nn

from pie.drivers.models.layers import apply_rotary, qkv_projection, rope_inv_freq

ENCODER_PREFIXES = ("encoder.", "encoder_transformer.", "downsample.")
"""Checkpoint names (inside the codec) of the encoding half, which decoding never reads."""


@frozen(kw_only=True)
class MimiConfig:
    """The decoder's facts from a Mimi config dict (a CSM config's `codec_config`); a key the dict
    leaves out or sets to null takes transformers' default."""

    sampling_rate: int = 24_000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = field(default=(8, 6, 5, 4), converter=tuple)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    compress: int = 2
    trim_right_ratio: float = 1.0
    use_conv_shortcut: bool = False
    codebook_size: int = 2048
    codebook_dim: int | None = None
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    vector_quantization_hidden_dimension: int = 256
    upsample_groups: int = 512
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    attention_bias: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 250
    frame_rate: float | None = None
    """Code frames a second (None: sampling_rate / (2 * the ratios' product), as transformers)."""

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> MimiConfig:
        """ValueError names a setting this decoder does not implement."""
        required = (("use_causal_conv", True), ("pad_mode", "constant"), ("hidden_act", "gelu"))
        for key, want in required:
            if raw.get(key, want) != want:
                raise ValueError(f"mimi: unsupported {key}={raw[key]!r}; only {want!r}")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"mimi: unsupported rope type {rope['rope_type']!r}")
        names = {f.name for f in attrs.fields(cls)}
        values = {k: v for k, v in raw.items() if k in names and v is not None}
        values["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        values["frame_rate"] = raw.get("frame_rate") or raw.get("_frame_rate")
        config = cls(**values)
        if config.code_frame_rate == config.latent_frame_rate:
            # transformers' decoder cannot run without its upsampling convolution either.
            raise ValueError("mimi: unsupported code frames at the latent rate (no upsampling)")
        return config

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def latent_frame_rate(self) -> int:
        """Frames a second of the decoder transformer (transformers' `encodec_frame_rate`)."""
        return math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))

    @property
    def code_frame_rate(self) -> float:
        hop = math.prod(self.upsampling_ratios)
        return self.frame_rate if self.frame_rate else self.sampling_rate / (2 * hop)

    @property
    def latent_stride(self) -> int:
        """Latent frames per code frame: the upsampling convolution's stride."""
        return int(self.latent_frame_rate / self.code_frame_rate)


class CausalConv1d(nn.Module):
    """A Conv1d padded with zeros on the left, so that an output sees no later input, and on the
    right up to a whole last stride."""

    def __init__(
        self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation)
        self.span = (kernel - 1) * dilation + 1
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length, left = x.shape[-1], self.span - self.stride
        frames = math.ceil((length - self.span + left) / self.stride + 1) - 1
        right = frames * self.stride + self.span - left - length
        return self.conv(F.pad(x, (left, right)))


class CausalConvTranspose1d(nn.Module):
    """A ConvTranspose1d with its overhang (kernel - stride) trimmed, by default on the right."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel: int,
        stride: int,
        trim_right_ratio: float,
        groups: int = 1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride, groups=groups, bias=bias)
        self.trim_right = math.ceil((kernel - stride) * trim_right_ratio)
        self.trim_left = kernel - stride - self.trim_right

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.trim_left : y.shape[-1] - self.trim_right]


class ResnetBlock(nn.Module):
    """SEANet's residual unit: ELU, dilated conv to a narrower width, ELU, 1x1 conv back."""

    def __init__(self, config: MimiConfig, dim: int, dilation: int) -> None:
        super().__init__()
        narrow = dim // config.compress
        self.block = nn.Sequential(
            nn.ELU(),
            CausalConv1d(dim, narrow, config.residual_kernel_size, dilation=dilation),
            nn.ELU(),
            CausalConv1d(narrow, dim, 1),
        )
        self.shortcut = CausalConv1d(dim, dim, 1) if config.use_conv_shortcut else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shortcut(x) + self.block(x)


class SeanetDecoder(nn.Module):
    """Latents [B, hidden, T] to samples [B, channels, T * the ratios' product]."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        width = config.num_filters * 2 ** len(config.upsampling_ratios)
        layers: list[nn.Module] = [CausalConv1d(config.hidden_size, width, config.kernel_size)]
        for ratio in config.upsampling_ratios:
            up = CausalConvTranspose1d(width, width // 2, 2 * ratio, ratio, config.trim_right_ratio)
            layers += [nn.ELU(), up]
            width //= 2
            for j in range(config.num_residual_layers):
                layers.append(ResnetBlock(config, width, config.dilation_growth_rate**j))
        layers += [nn.ELU(), CausalConv1d(width, config.audio_channels, config.last_kernel_size)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """q [T, Hq, D] for the last T of the S tokens that k, v [S, Hkv, D] hold; each sees the
    tokens up to its own, at most `window` of them (None: all). Returns [T, Hq, D]."""
    new, total = q.shape[0], k.shape[0]
    visible = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)
    if window is not None:
        visible &= ~torch.ones_like(visible).tril(total - new - window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, enable_gqa=True
    )
    return out.transpose(0, 1)


class MimiAttention(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.window = config.attention_head_dim, config.sliding_window
        bias = config.attention_bias
        self.qkv_proj = qkv_projection(
            config.hidden_size, self.heads, self.kv_heads, self.head_dim, bias=bias
        )
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv_proj.forward_split(x)
        q = apply_rotary(q.view(-1, self.heads, self.head_dim), rope)
        k = apply_rotary(k.view(-1, self.kv_heads, self.head_dim), rope)
        v = v.view(-1, self.kv_heads, self.head_dim)
        return self.o_proj(causal_attention(q, k, v, self.window).flatten(1))


class LayerScale(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class MimiMLP(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MimiTransformerLayer(nn.Module):
    """Pre-LayerNorm attention and MLP, each residual branch scaled per channel."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.norm_eps
        self.input_layernorm = nn.LayerNorm(size, eps=eps)
        self.self_attn = MimiAttention(config)
        self.self_attn_layer_scale = LayerScale(size)
        self.post_attention_layernorm = nn.LayerNorm(size, eps=eps)
        self.mlp = MimiMLP(config)
        self.mlp_layer_scale = LayerScale(size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class MimiTransformer(nn.Module):
    """Causal sliding-window transformer over one clip's latent frames [T, hidden]."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            MimiTransformerLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.head_dim, self.theta = config.attention_head_dim, config.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Angles computed per clip, not looked up: a clip may run past max_position_embeddings.
        inv_freq = rope_inv_freq(self.head_dim, self.theta, None).to(x.device)
        angles = torch.arange(x.shape[0], device=x.device, dtype=torch.float32)[:, None] * inv_freq
        rope = (angles.cos(), angles.sin())
        for layer in self.layers:
            x = layer(x, rope)
        return x


class Codebook(nn.Module):
    """One codebook's centroids, kept as the running sums and counts the codec was trained with
    (parameters, not buffers, so that the loader fills them)."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        dim = config.codebook_dim or config.hidden_size
        self.cluster_usage = nn.Parameter(torch.ones(config.codebook_size), requires_grad=False)
        self.embed_sum = nn.Parameter(torch.zeros(config.codebook_size, dim), requires_grad=False)

    def centroids(self) -> torch.Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class VectorQuantization(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.codebook = Codebook(config)


class ResidualQuantizer(nn.Module):
    """Codebooks whose centroids add up, then a projection to the latent width."""

    def __init__(self, config: MimiConfig, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(config) for _ in range(count))
        width = config.vector_quantization_hidden_dimension
        self.output_proj = (
            nn.Conv1d(width, config.hidden_size, 1, bias=False)
            if width != config.hidden_size
            else None
        )

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [K, T] for the first K codebooks -> latents [T, hidden]."""
        latent = F.embedding(codes[0], self._centroids(0))
        for index in range(1, codes.shape[0]):
            latent = latent + F.embedding(codes[index], self._centroids(index))
        if self.output_proj is None:
            return latent
        return F.linear(latent, self.output_proj.weight[..., 0])

    def _centroids(self, index: int) -> torch.Tensor:
        quantization = self.layers[index]
        assert isinstance(quantization, VectorQuantization)
        return quantization.codebook.centroids()


class SplitQuantizer(nn.Module):
    """Mimi's quantizer: the first (semantic) codebooks and the rest (acoustic), each with its own
    output projection, summed."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.semantic_count = config.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualQuantizer(config, self.semantic_count)
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(
            config, config.num_quantizers - self.semantic_count
        )

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        latent = self.semantic_residual_vector_quantizer.decode(codes[: self.semantic_count])
        if codes.shape[0] > self.semantic_count:
            rest = codes[self.semantic_count :]
            latent = latent + self.acoustic_residual_vector_quantizer.decode(rest)
        return latent


class MimiDecoder(nn.Module):
    """Codes to samples. Parameter names follow the checkpoint's inside `codec_model.`."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = SplitQuantizer(config)
        stride, size = config.latent_stride, config.hidden_size
        self.upsample = CausalConvTranspose1d(
            size, size, 2 * stride, stride, config.trim_right_ratio,
            groups=config.upsample_groups, bias=False,
        )  # fmt: skip
        self.decoder_transformer = MimiTransformer(config)
        self.decoder = SeanetDecoder(config)

    @staticmethod
    def reads_weight(name: str) -> bool:
        """Whether decoding uses the checkpoint weight `name` (relative to the codec)."""
        unread = name.startswith(ENCODER_PREFIXES) or name.endswith(
            (".input_proj.weight", ".codebook.initialized")
        )
        return not unread

    @property
    def samples_per_frame(self) -> int:
        return self.config.latent_stride * math.prod(self.config.upsampling_ratios)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [frames, K] int64 (K codebooks, the first K of the codec's) -> samples
        [channels, frames * samples_per_frame] float32; ValueError on codes it cannot read."""
        self._check(codes)
        channels = self.config.audio_channels
        if codes.shape[0] == 0:
            return torch.zeros(channels, 0)
        with torch.inference_mode():
            latent = self.upsample(self.quantizer.decode(codes.T).T[None])
            hidden = self.decoder_transformer(latent[0].T)
            return self.decoder(hidden.T[None])[0].float()

    def _check(self, codes: torch.Tensor) -> None:
        config = self.config
        if codes.dim() != 2 or not config.num_semantic_quantizers <= codes.shape[1]:
            raise ValueError(f"mimi: codes must be [frames, codebooks], got {tuple(codes.shape)}")
        if codes.shape[1] > config.num_quantizers:
            raise ValueError(
                f"mimi: {codes.shape[1]} codebooks, over the codec's {config.num_quantizers}"
            )
        if codes.numel() and not 0 <= int(codes.min()) <= int(codes.max()) < config.codebook_size:
            raise ValueError(f"mimi: codes must lie in [0, {config.codebook_size})")
