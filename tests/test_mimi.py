"""pie's Mimi decoder against transformers' MimiModel.decode on tiny random codecs: codes of
several lengths (past the decoder transformer's sliding window), fewer codebooks than the codec
has, variants of the SEANet decoder, and the codes and configs it refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import MimiConfig as HfMimiConfig
from transformers import MimiModel

from pie.drivers.models.mimi import MimiConfig, MimiDecoder

TOLERANCE = 1e-4
"""Max abs sample difference allowed against transformers, float32."""
TINY: dict[str, Any] = dict(
    hidden_size=32,
    num_filters=4,
    upsampling_ratios=[4, 2],
    codebook_size=64,
    codebook_dim=16,
    num_quantizers=5,
    vector_quantization_hidden_dimension=16,
    upsample_groups=32,
    num_hidden_layers=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    sliding_window=3,
)
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    # Two residual units per stage (dilation 1 then 2), 1x1 shortcuts, grouped-query attention,
    # two semantic codebooks, stereo, a trim split between both ends.
    "wide": dict(
        num_residual_layers=2,
        use_conv_shortcut=True,
        num_key_value_heads=2,
        num_semantic_quantizers=2,
        audio_channels=2,
        trim_right_ratio=0.5,
        upsample_groups=8,
    ),
    # Codebooks as wide as the latents: no output projection.
    "no-projection": dict(vector_quantization_hidden_dimension=32, codebook_dim=32),
}


def tiny_codec(variant: dict[str, Any], seed: int = 0) -> tuple[MimiModel, MimiDecoder]:
    """A random transformers Mimi (weights and codebooks perturbed) and pie's decoder with its
    weights."""
    torch.manual_seed(seed)
    hf_config = HfMimiConfig(**{**TINY, **variant})
    reference = perturbed(MimiModel(hf_config).eval())
    decoder = MimiDecoder(MimiConfig.from_hf(hf_config.to_dict()))
    decoder.load_state_dict(decoder_weights(reference.state_dict()))
    return reference, decoder


def perturbed(model: Any) -> Any:
    """model with every weight moved off its initial value and random codebooks (transformers
    starts them at zero)."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("embed_sum"):
                buffer.normal_()
            elif name.endswith("cluster_usage"):
                buffer.uniform_(0.5, 2.0)
    return model


def decoder_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' MimiModel state dict in pie's decoder names: the decoding half only, q/k/v
    stacked into one projection."""
    renames = (
        ("decoder.decoder_seanet.", "decoder."),
        ("decoder.decoder_transformer.", "decoder_transformer."),
        ("decoder.upsample.", "upsample."),
    )
    weights = {}
    for name, tensor in state.items():
        if name.startswith("encoder.") or name.endswith(("initialized", "input_proj.weight")):
            continue
        for old, new in renames:
            name = name.replace(old, new) if name.startswith(old) else name
        weights[name] = tensor
    for name in [n for n in weights if n.endswith("q_proj.weight")]:
        parts = [weights.pop(name.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        weights[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
    return weights


def reference_audio(reference: MimiModel, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return reference.decode(codes.T[None]).audio_values[0]


@pytest.mark.integration
@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_decode_matches_transformers(variant: str) -> None:
    reference, decoder = tiny_codec(VARIANTS[variant])
    generator = torch.Generator().manual_seed(1)
    for frames, books in ((1, 5), (9, 5), (6, 3)):
        codes = torch.randint(0, 64, (frames, books), generator=generator)
        audio = decoder.decode(codes)
        expected = reference_audio(reference, codes)
        assert audio.dtype == torch.float32 and audio.shape == expected.shape
        assert audio.shape[1] == frames * decoder.samples_per_frame
        assert (audio - expected).abs().max() <= TOLERANCE


@pytest.mark.unit
def test_decoding_reads_no_encoder_weight() -> None:
    for name in (
        "encoder.layers.0.conv.weight",
        "encoder_transformer.layers.0.self_attn.q_proj.weight",
        "downsample.conv.weight",
        "quantizer.semantic_residual_vector_quantizer.input_proj.weight",
        "quantizer.acoustic_residual_vector_quantizer.layers.2.codebook.initialized",
    ):
        assert not MimiDecoder.reads_weight(name)
    for name in (
        "decoder.layers.0.conv.weight",
        "decoder_transformer.layers.0.self_attn.q_proj.weight",
        "upsample.conv.weight",
        "quantizer.semantic_residual_vector_quantizer.output_proj.weight",
        "quantizer.acoustic_residual_vector_quantizer.layers.2.codebook.embed_sum",
    ):
        assert MimiDecoder.reads_weight(name)


@pytest.mark.unit
def test_no_frames_decode_to_no_samples() -> None:
    decoder = MimiDecoder(MimiConfig.from_hf(TINY))
    assert decoder.decode(torch.zeros(0, 4, dtype=torch.int64)).shape == (1, 0)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("codes", "complaint"),
    [
        (torch.full((3, 2), 64), r"codes must lie in \[0, 64\)"),
        (torch.full((3, 2), -1), r"codes must lie in \[0, 64\)"),
        (torch.zeros(3, 6, dtype=torch.int64), "6 codebooks, over the codec's 5"),
        (torch.zeros(3, dtype=torch.int64), r"codes must be \[frames, codebooks\]"),
    ],
    ids=["past-vocab", "negative", "too-many-books", "flat"],
)
def test_decode_refuses_codes_it_cannot_read(codes: torch.Tensor, complaint: str) -> None:
    decoder = MimiDecoder(MimiConfig.from_hf(TINY))
    with pytest.raises(ValueError, match=f"mimi: {complaint}"):
        decoder.decode(codes)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        (dict(use_causal_conv=False), "use_causal_conv=False"),
        (dict(pad_mode="reflect"), "pad_mode='reflect'"),
        (dict(hidden_act="relu"), "hidden_act='relu'"),
        (dict(rope_parameters=dict(rope_type="linear", factor=2.0)), "rope type 'linear'"),
        (dict(frame_rate=3000), "code frames at the latent rate"),
    ],
    ids=["non-causal", "reflect-padding", "relu", "scaled-rope", "no-upsampling"],
)
def test_config_refuses_what_is_not_implemented(setting: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValueError, match=f"mimi: unsupported {complaint}"):
        MimiConfig.from_hf({**TINY, **setting})
