"""Whisper log-mel features against transformers' WhisperFeatureExtractor on random audio
and a 440 Hz sine, padded (1 s, 5 s) and cut (31 s), with 80 and 128 bins. Both run the same
torch STFT in float32 on the same float32 filters, so they come out bit for bit equal here;
1e-4 leaves room for another torch build's FFT."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
from transformers import WhisperFeatureExtractor

from pie.media import decode_audio
from pie.media.whisper_features import WhisperFeatures, log_mel, mel_filters

pytestmark = pytest.mark.unit

RATE = 16000
TOLERANCE = 1e-4


def reference(samples: np.ndarray, feature_size: int) -> np.ndarray:
    extractor = WhisperFeatureExtractor(feature_size=feature_size)
    out = extractor(samples, sampling_rate=RATE, return_tensors="np")
    return out["input_features"][0]


def sine(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


def noise(seconds: float) -> np.ndarray:
    rng = np.random.default_rng()
    return rng.uniform(-1.0, 1.0, int(seconds * RATE)).astype(np.float32)


@pytest.mark.parametrize("feature_size", [80, 128])
@pytest.mark.parametrize("seconds", [1, 5, 31])
@pytest.mark.parametrize("source", [sine, noise])
def test_features_match_transformers(source, seconds: int, feature_size: int) -> None:
    samples = source(seconds)
    features, _ = log_mel(samples, WhisperFeatures(feature_size=feature_size))
    expected = reference(samples, feature_size)
    assert features.dtype == np.float32
    assert features.shape == expected.shape == (feature_size, 3000)
    np.testing.assert_allclose(features, expected, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("feature_size", [80, 128])
def test_filters_match_transformers(feature_size: int) -> None:
    extractor = WhisperFeatureExtractor(feature_size=feature_size)
    ours = mel_filters(WhisperFeatures(feature_size=feature_size))
    np.testing.assert_allclose(ours, extractor.mel_filters.astype(np.float32), rtol=1e-6)


def test_valid_frames_of_a_short_clip_match_the_attention_mask() -> None:
    samples = sine(1.2345)
    _, valid = log_mel(samples)
    extractor = WhisperFeatureExtractor()
    out = extractor(samples, sampling_rate=RATE, return_attention_mask=True, return_tensors="np")
    assert valid == int(out["attention_mask"][0].sum()) == 124


def test_audio_past_the_chunk_counts_as_the_whole_chunk() -> None:
    _, valid = log_mel(sine(31))
    assert valid == 3000


def test_settings_read_from_a_preprocessor_config() -> None:
    config = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": 30,
        "padding_value": 0.0,
        "return_attention_mask": True,
    }
    settings = WhisperFeatures.from_preprocessor_config(config)
    assert settings == WhisperFeatures(feature_size=128)
    assert settings.frames == 3000
    assert WhisperFeatures.from_preprocessor_config({}) == WhisperFeatures()


def test_stereo_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="mono"):
        log_mel(np.zeros((2, RATE), np.float32))


def wav_bytes(pcm: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


def test_wav_bytes_decode_into_features_of_the_same_tone() -> None:
    pcm = np.round(sine(2) * 32767).astype("<i2")
    decoded = decode_audio(wav_bytes(pcm, RATE), rate=RATE)
    features, valid = log_mel(decoded.samples)
    assert valid == 200
    # 16-bit PCM decodes to pcm / 32768.
    expected = reference((pcm / 32768).astype(np.float32), 80)
    np.testing.assert_allclose(features, expected, rtol=0, atol=TOLERANCE)
    loudest = features[:, :valid].mean(axis=1).argmax()
    centers = np.argmax(mel_filters(WhisperFeatures()), axis=0) * RATE / 400
    assert abs(centers[loudest] - 440.0) < 80.0
