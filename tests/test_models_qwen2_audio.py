"""Qwen2-Audio against transformers on a tiny random checkpoint: the span each clip becomes
equals the processor's input_ids, logits of audio and text within 1e-4 (two clips of different
lengths in one sequence, and a clip filling the whole window), clips encoded together equal
each encoded alone, the soft-token count per clip length, and what the model refuses."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from dense_attention import DenseCausalAttention
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    WhisperFeatureExtractor,
)

from pie.drivers.loader import LoadedModel, load_model
from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.models import qwen2_audio
from pie.drivers.models.media import MediaRows, PreparedMedia, place_span
from pie.media import DecodedAudio
from tests.tiny_models import TINY_SHAPE, TINY_TOLERANCE, VOCAB, write_tiny_tokenizer

pytestmark = pytest.mark.unit

RATE = 16000
MEL_BINS = 128
AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
CLIP = "<|audio_bos|><|AUDIO|><|audio_eos|>"
BATCH_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2AudioForConditionalGeneration (text hidden 64, audio d_model 32), its
    tokenizer with the audio tokens added, and a 128-bin feature extractor's settings."""
    folder = tmp_path_factory.mktemp("qwen2_audio")
    write_tiny_tokenizer(folder, VOCAB)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen2AudioConfig(
        text_config=dict(
            model_type="qwen2",
            **{**TINY_SHAPE, "vocab_size": len(tokenizer), "max_position_embeddings": 1024},
        ),
        audio_config=dict(
            model_type="qwen2_audio_encoder",
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            num_mel_bins=MEL_BINS,
            max_source_positions=1500,
        ),
        audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
    )
    model = Qwen2AudioForConditionalGeneration(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=MEL_BINS).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Qwen2AudioForConditionalGeneration:
    model = Qwen2AudioForConditionalGeneration.from_pretrained(
        checkpoint, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def processor(checkpoint: Path) -> Qwen2AudioProcessor:
    return Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor.from_pretrained(checkpoint),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(checkpoint),
    )


@pytest.fixture(scope="module")
def pie_model(checkpoint: Path) -> LoadedModel:
    return load_model(str(checkpoint), torch.float32, "cpu")


def clip(seconds: float, rate: int = RATE) -> DecodedAudio:
    samples = np.random.default_rng().uniform(-1.0, 1.0, round(seconds * rate))
    return DecodedAudio(
        samples=samples.astype(np.float32),
        rate=rate,
        seconds=seconds,
        format="wav",
        codec="pcm_f32le",
    )


def towers(loaded: LoadedModel) -> qwen2_audio.Qwen2AudioForConditionalGeneration:
    assert isinstance(loaded.model, qwen2_audio.Qwen2AudioForConditionalGeneration)
    return loaded.model


def prepare(loaded: LoadedModel, audio: DecodedAudio, kind: str = "audio") -> PreparedMedia:
    return towers(loaded).prepare(kind, audio, loaded.tokenizer.encode)


def pie_logits(
    loaded: LoadedModel, parts: Sequence[str | DecodedAudio]
) -> tuple[list[int], torch.Tensor]:
    """The prompt's token ids and logits: text tokenized, each clip prepared, encoded and laid
    out where it stands, its soft tokens' rows replaced by the encoder's output."""
    model = towers(loaded)
    items = [prepare(loaded, part) for part in parts if isinstance(part, DecodedAudio)]
    embeds = model.encode(items)
    ids: list[int] = []
    rows: list[int] = []
    indices: list[torch.Tensor] = []
    queue = iter(items)
    for part in parts:
        if isinstance(part, str):
            ids += loaded.tokenizer.encode(part)
            continue
        placed = place_span(next(queue).span, len(ids))
        rows += [len(ids) + i for i in placed.soft]
        indices.append(placed.rope_index)
        ids += placed.tokens
    media = MediaRows(
        rows=torch.tensor(rows), embeds=torch.cat(embeds), rope_index=torch.cat(indices)
    )
    tokens = torch.tensor(ids)
    with torch.inference_mode():
        hidden = model(tokens, torch.arange(len(ids)), DenseCausalAttention(), media=media)
        return ids, model.compute_logits(hidden)


def reference_logits(
    model: Qwen2AudioForConditionalGeneration,
    processor: Qwen2AudioProcessor,
    parts: Sequence[str | DecodedAudio],
) -> tuple[list[int], torch.Tensor]:
    text = "".join(part if isinstance(part, str) else CLIP for part in parts)
    audio = [part.samples for part in parts if isinstance(part, DecodedAudio)]
    inputs = processor(text=text, audio=audio, sampling_rate=RATE, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**inputs).logits[0].float()
    return inputs["input_ids"][0].tolist(), logits


@pytest.mark.parametrize(
    "seconds", [(1.3, 4.0), (30.0,)], ids=["two-clips-1.3s-4s", "whole-window-30s"]
)
def test_audio_and_text_logits_match_transformers(
    pie_model: LoadedModel,
    reference: Qwen2AudioForConditionalGeneration,
    processor: Qwen2AudioProcessor,
    seconds: tuple[float, ...],
) -> None:
    parts: list[str | DecodedAudio] = ["Hello "]
    for i, length in enumerate(seconds):
        parts += [clip(length), f" the fox {i} "]
    ids, logits = pie_logits(pie_model, parts)
    expected_ids, expected = reference_logits(reference, processor, parts)
    assert ids == expected_ids
    torch.testing.assert_close(logits, expected, rtol=0, atol=TINY_TOLERANCE)


def test_clips_encoded_together_equal_each_encoded_alone(pie_model: LoadedModel) -> None:
    items = [prepare(pie_model, clip(seconds)) for seconds in (4.0, 1.3, 30.0, 0.7)]
    with torch.inference_mode():
        together = towers(pie_model).encode(items)
        alone = [towers(pie_model).encode([item])[0] for item in items]
    for batched, single, item in zip(together, alone, items, strict=True):
        assert batched.shape == (item.soft_count, TINY_SHAPE["hidden_size"])
        torch.testing.assert_close(batched, single, rtol=0, atol=BATCH_TOLERANCE)


@pytest.mark.parametrize("seconds", [0.021, 0.5, 1.3, 7.777, 29.99, 30.0])
def test_soft_tokens_follow_the_clip_length_as_the_processor_counts(
    pie_model: LoadedModel, processor: Qwen2AudioProcessor, seconds: float
) -> None:
    audio = clip(seconds)
    item = prepare(pie_model, audio)
    inputs = processor(text=CLIP, audio=[audio.samples], sampling_rate=RATE)
    frames = int(inputs["feature_attention_mask"][0].sum())
    assert (
        item.soft_count
        == qwen2_audio.soft_token_count(frames)
        == inputs["input_ids"][0].count(processor.audio_token_id)
    )
    assert item.grid == (1, 1, item.soft_count)
    np.testing.assert_allclose(
        item.inputs["features"].numpy(), inputs["input_features"][0], rtol=0, atol=1e-4
    )


@pytest.mark.parametrize(
    ("kind", "audio", "message"),
    [
        ("image", clip(1.0), "reads audio only, not image"),
        ("video", clip(1.0), "reads audio only, not video"),
        ("audio", clip(30.5), "longer than the encoder's window of 30 s"),
        ("audio", clip(1.0, rate=8000), "must be at 16000 samples a second"),
        ("audio", clip(0.0), "too short"),
    ],
    ids=["image", "video", "over-30s", "8kHz", "empty"],
)
def test_refusals_name_the_family_and_the_problem(
    pie_model: LoadedModel, kind: str, audio: DecodedAudio, message: str
) -> None:
    with pytest.raises(ValueError, match=f"qwen2_audio.*{message}"):
        prepare(pie_model, audio, kind)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"feature_size": 80}, "80 mel bins by 3000"),
        ({"feature_size": 128, "chunk_length": 20}, "128 mel bins by 2000"),
    ],
)
def test_feature_settings_the_encoder_cannot_read_are_refused(
    pie_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, settings: dict[str, int], message: str
) -> None:
    monkeypatch.setattr(pie_model.model, "processor", settings)
    with pytest.raises(ValueError, match=f"qwen2_audio.*{message} frames; the encoder reads 128"):
        prepare(pie_model, clip(1.0))


def test_a_released_config_takes_qwen2_defaults_for_what_it_leaves_out() -> None:
    """The released checkpoints' text_config states only what differs from Qwen2Config."""
    raw = {
        "model_type": "qwen2_audio",
        "audio_config": {"model_type": "qwen2_audio_encoder", "d_model": 1280},
        "audio_token_index": 151646,
        "text_config": {
            "model_type": "qwen2",
            "intermediate_size": 11008,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "vocab_size": 156032,
            "eos_token_id": 151645,
        },
    }
    config = model_config_from_hf(raw)
    assert (config.model_type, config.hidden_size, config.num_layers) == ("qwen2_audio", 4096, 32)
    assert (config.num_heads, config.num_kv_heads, config.intermediate_size) == (32, 32, 11008)
    assert (config.vocab_size, config.max_position_embeddings) == (156032, 8192)
    assert config.eos_token_ids == (151645,)


def test_an_audio_activation_other_than_gelu_is_refused() -> None:
    raw = {
        "model_type": "qwen2_audio",
        "audio_config": {"activation_function": "relu"},
        "text_config": {"model_type": "qwen2"},
    }
    with pytest.raises(ValueError, match="qwen2_audio.*activation_function 'relu'"):
        model_config_from_hf(raw)
