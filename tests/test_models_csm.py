"""CSM text to speech against transformers on a tiny random checkpoint loaded through pie's loader:
the prompt CsmProcessor's chat template builds, greedy frames equal to `generate`'s, audio equal
to its Mimi decode, an eos frame ending the utterance, the WAV encoding of the clip, and the
requests the model refuses."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (
    CsmConfig,
    CsmForConditionalGeneration,
    CsmProcessor,
    EncodecFeatureExtractor,
    PreTrainedTokenizerFast,
)

from pie.drivers.loader import LoadedModel, load_model
from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.models.csm import CsmForConditionalGeneration as PieCsm
from pie.media.speech import SpeechClip
from tests.test_mimi import TINY as TINY_CODEC
from tests.test_mimi import perturbed

AUDIO_TOLERANCE = 1e-4
"""Max abs sample difference allowed against transformers' Mimi decode, float32."""
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>"]
CORPUS = ["Hello there, how are you today?", "The quick brown fox.", "pie speaks"]
CODEC: dict[str, Any] = {**TINY_CODEC, "model_type": "mimi", "num_quantizers": 6}
DEPTH: dict[str, Any] = dict(
    num_codebooks=4,
    backbone_hidden_size=64,
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8,
)
CSM: dict[str, Any] = dict(
    num_codebooks=4,
    vocab_size=64,
    text_vocab_size=400,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=0,
    pad_token_id=2,
    audio_token_id=2,
    audio_eos_token_id=3,
    codebook_pad_token_id=63,
    codebook_eos_token_id=0,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
)


def save_tiny_csm(folder: Path) -> Any:
    """A random transformers CSM (every weight and codebook perturbed) and a tokenizer in folder."""
    torch.manual_seed(0)
    config = CsmConfig(**CSM, depth_decoder_config=DEPTH, codec_config=CODEC)
    model = perturbed(CsmForConditionalGeneration(config).eval())
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return model


def tokenizer() -> PreTrainedTokenizerFast:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[1]
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    folder = tmp_path_factory.mktemp("csm")
    reference = save_tiny_csm(folder)
    return reference, load_model(str(folder), torch.float32, "cpu")


def pie_model(loaded: LoadedModel) -> PieCsm:
    assert isinstance(loaded.model, PieCsm)
    return loaded.model


def hf_frames(reference: Any, ids: list[int], frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy codes [frames, C] and its audio for them."""
    with torch.inference_mode():
        kwargs = dict(max_new_tokens=frames, do_sample=False, depth_decoder_do_sample=False)
        codes = reference.generate(input_ids=torch.tensor([ids]), **kwargs)[0]
        audio = reference.generate(input_ids=torch.tensor([ids]), output_audio=True, **kwargs)[0]
    return codes, audio


@pytest.mark.integration
def test_prompt_matches_the_processors_chat_template(tiny: tuple[Any, LoadedModel]) -> None:
    _, loaded = tiny
    template = CHAT_TEMPLATE
    processor = CsmProcessor(EncodecFeatureExtractor(), tokenizer(), chat_template=template)
    text = "Hello there, the fox speaks."
    for speaker in pie_model(loaded).voices():
        turn: Any = [{"role": str(speaker), "content": [{"type": "text", "text": text}]}]
        expected: Any = processor.apply_chat_template(turn, tokenize=True, return_dict=True)
        ids = pie_model(loaded).prompt_ids(text, speaker, loaded.tokenizer.encode)
        assert ids == expected["input_ids"][0].tolist()


@pytest.mark.integration
def test_greedy_frames_and_audio_match_transformers(tiny: tuple[Any, LoadedModel]) -> None:
    reference, loaded = tiny
    model = pie_model(loaded)
    ids = model.prompt_ids("The quick brown fox.", 1, loaded.tokenizer.encode)
    codes, clip = model.speak(ids, max_frames=7)
    expected_codes, expected_audio = hf_frames(reference, ids, 7)
    assert codes.dtype == torch.int64 and codes.shape == (7, 4)
    assert torch.equal(codes, expected_codes)
    assert clip.sample_rate == 24_000 and clip.channels == 1
    assert clip.samples.shape == (1, expected_audio.numel())
    diff = np.abs(clip.samples[0] - expected_audio.numpy()).max()
    assert diff <= AUDIO_TOLERANCE, diff
    assert clip.duration() == pytest.approx(7 * 16 / 24_000)


@pytest.mark.integration
def test_an_eos_frame_ends_the_utterance_as_in_transformers(
    tiny: tuple[Any, LoadedModel],
) -> None:
    """Zero first-codebook logits, and zero logits for codebooks 1..C-2, make those codes the
    eos code 0: both implementations stop after that frame, and both decode it (its last code
    is not eos)."""
    reference, loaded = tiny
    model = pie_model(loaded)
    ids = model.prompt_ids("pie speaks", 0, loaded.tokenizer.encode)
    with eos_heads(reference), eos_heads(model):
        codes, clip = model.speak(ids, max_frames=5)
        expected_codes, expected_audio = hf_frames(reference, ids, 5)
    assert codes.shape == (1, 4) and codes[0, -1] != 0
    assert torch.equal(codes, expected_codes)
    assert np.abs(clip.samples[0] - expected_audio.numpy()).max() <= AUDIO_TOLERANCE


@contextmanager
def eos_heads(model: Any) -> Iterator[None]:
    """model's first-codebook head, and its depth heads but the last, all zero for a while."""
    heads = (model.lm_head.weight, model.depth_decoder.codebooks_head.weight[:-1])
    saved = [head.detach().clone() for head in heads]
    with torch.no_grad():
        for head in heads:
            head.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for head, value in zip(heads, saved, strict=True):
                head.copy_(value)


@pytest.mark.integration
def test_sampling_draws_codes_within_the_vocabulary(tiny: tuple[Any, LoadedModel]) -> None:
    _, loaded = tiny
    model = pie_model(loaded)
    ids = model.prompt_ids("Hello", 0, loaded.tokenizer.encode)
    codes, clip = model.speak(ids, max_frames=3, greedy=False)
    assert 1 <= codes.shape[0] <= 3 and codes.shape[1] == 4
    assert 0 <= int(codes.min()) and int(codes.max()) < 64
    assert clip.samples.dtype == np.float32


@pytest.mark.integration
def test_the_clip_reads_back_from_its_wav(tiny: tuple[Any, LoadedModel]) -> None:
    _, loaded = tiny
    model = pie_model(loaded)
    _, clip = model.speak(model.prompt_ids("Hello", 0, loaded.tokenizer.encode), max_frames=4)
    stereo = SpeechClip(
        samples=np.random.default_rng(0).uniform(-1, 1, (2, 300)).astype(np.float32),
        sample_rate=16_000,
    )
    # The random model's samples run far past [-1, 1]: as they are (clipped), and scaled in.
    scaled = SpeechClip(samples=clip.samples / np.abs(clip.samples).max(), sample_rate=24_000)
    for original in (clip, scaled, stereo):
        rate, samples = read_wav(original.to_wav())
        assert rate == original.sample_rate
        assert samples.shape == original.samples.shape
        assert np.abs(samples - np.clip(original.samples, -1, 1)).max() <= 1 / 32768


@pytest.mark.unit
@pytest.mark.parametrize(
    ("samples", "rate", "complaint"),
    [
        (np.zeros(10, np.float32), 24_000, r"must be \[1 or 2 channels, count\]"),
        (np.zeros((3, 10), np.float32), 24_000, r"must be \[1 or 2 channels, count\]"),
        (np.zeros((1, 10), np.float64), 24_000, "must be float32"),
        (np.zeros((1, 10), np.float32), 0, "sample_rate must be at least 1"),
    ],
    ids=["flat", "three-channels", "float64", "no-rate"],
)
def test_speech_clip_refuses_what_it_cannot_hold(
    samples: np.ndarray, rate: int, complaint: str
) -> None:
    with pytest.raises(ValueError, match=complaint):
        SpeechClip(samples=samples, sample_rate=rate)


@pytest.mark.unit
def test_an_empty_clip_is_a_wav_of_no_samples() -> None:
    clip = SpeechClip(samples=np.zeros((1, 0), np.float32), sample_rate=24_000)
    assert clip.duration() == 0.0
    rate, samples = read_wav(clip.to_wav())
    assert rate == 24_000 and samples.shape == (1, 0)


def read_wav(data: bytes) -> tuple[int, np.ndarray]:
    """(rate, samples [channels, count] in [-1, 1)) of a 16-bit PCM WAV file, read with av."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        assert stream.codec_context.name == "pcm_s16le"
        channels = stream.codec_context.channels
        pieces = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
    interleaved = np.concatenate([np.zeros(0, np.int16), *pieces]).astype(np.float32) / 32768
    return stream.rate, interleaved.reshape(-1, channels).T


@pytest.mark.integration
@pytest.mark.parametrize(
    ("call", "complaint"),
    [
        (lambda m, enc: m.prompt_ids("Hello", 7, enc), "unknown speaker 7"),
        (lambda m, enc: m.speak(m.prompt_ids("Hello", 0, enc), max_frames=0), "max_frames"),
        (lambda m, enc: m.speak([0, 2, 1], max_frames=2), "audio context"),
        (lambda m, enc: m.speak([0, 1], max_frames=63), "exceed 64 positions"),
        (lambda m, enc: m.speak([], max_frames=2), "empty prompt"),
    ],
    ids=["unknown-speaker", "no-frames", "audio-in-prompt", "too-long", "empty"],
)
def test_refusals_name_csm(tiny: tuple[Any, LoadedModel], call: Any, complaint: str) -> None:
    _, loaded = tiny
    with pytest.raises(ValueError, match=f"csm: .*{complaint}"):
        call(pie_model(loaded), loaded.tokenizer.encode)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (dict(codec_config=None), "config.json has no codec_config"),
        (dict(codec_config={**CODEC, "pad_mode": "reflect"}), "mimi: unsupported pad_mode"),
        (dict(depth_decoder_config={**DEPTH, "hidden_act": "gelu"}), "unsupported hidden_act"),
        (dict(depth_decoder_config={**DEPTH, "num_codebooks": 3}), "4 codebooks, not matched"),
    ],
    ids=["no-codec", "codec-padding", "depth-activation", "depth-codebooks"],
)
def test_config_refusals_name_csm(change: dict[str, Any], complaint: str) -> None:
    config = CsmConfig(**CSM, depth_decoder_config=DEPTH, codec_config=CODEC).to_dict()
    with pytest.raises(ValueError, match=f"csm: {complaint}"):
        model_config_from_hf({**config, **change})


CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- bos_token }}{{- '[' + message['role'] + ']' }}{{- message['content'][0]['text'] }}"
    "{{- eos_token }}"
    "{%- if message['content']|length > 1 %}{{- '<|AUDIO|><|audio_eos|>' }}{%- endif %}"
    "{%- endfor %}"
)
"""The rendering part of CSM's chat template (sesame/csm-1b, as transformers' conversion script
writes it), without its input validation."""
