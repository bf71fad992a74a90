"""Whisper's log-mel features: mono samples padded or cut to one chunk, turned into the
80- or 128-bin log-mel spectrogram a Whisper encoder (and Qwen2-Audio's) reads, as
transformers' WhisperFeatureExtractor gives them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from typing import Any

import numpy as np
import torch
from attrs import frozen
from numpy.typing import NDArray

MAX_FREQUENCY = 8000.0
"""Whisper's filters stop at 8 kHz whatever the sampling rate."""
LOG_FLOOR = 1e-10
DYNAMIC_RANGE = 8.0
"""Log10 units kept below the loudest bin (80 dB)."""


@frozen(kw_only=True)
class WhisperFeatures:
    """The settings of a Whisper feature extractor (`preprocessor_config.json`)."""

    feature_size: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30
    """Seconds of audio in one chunk: shorter audio is padded, longer audio cut."""
    padding_value: float = 0.0

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> WhisperFeatures:
        """Reads the keys transformers' WhisperFeatureExtractor reads, by their own names."""
        defaults = cls()
        return cls(
            feature_size=int(config.get("feature_size", defaults.feature_size)),
            sampling_rate=int(config.get("sampling_rate", defaults.sampling_rate)),
            hop_length=int(config.get("hop_length", defaults.hop_length)),
            n_fft=int(config.get("n_fft", defaults.n_fft)),
            chunk_length=int(config.get("chunk_length", defaults.chunk_length)),
            padding_value=float(config.get("padding_value", defaults.padding_value)),
        )

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def frames(self) -> int:
        """Feature frames in one chunk (3000 for 30 s at 16 kHz)."""
        return self.n_samples // self.hop_length


def _hertz_to_mel(hertz: NDArray[np.float64]) -> NDArray[np.float64]:
    """Slaney's mel scale: linear below 1 kHz (15 mels there), logarithmic above."""
    mels = 3.0 * hertz / 200.0
    above = hertz >= 1000.0
    mels[above] = 15.0 + np.log(hertz[above] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hertz(mels: NDArray[np.float64]) -> NDArray[np.float64]:
    hertz = 200.0 * mels / 3.0
    above = mels >= 15.0
    hertz[above] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[above] - 15.0))
    return hertz


@cache
def mel_filters(settings: WhisperFeatures) -> NDArray[np.float32]:
    """[n_fft / 2 + 1, feature_size]: triangles evenly spaced on Slaney's mel scale from 0 to
    8 kHz, each divided by its width in hertz over two (equal area), built in float64."""
    edges = np.array([0.0, MAX_FREQUENCY])
    low, high = _hertz_to_mel(edges)
    centers = _mel_to_hertz(np.linspace(low, high, settings.feature_size + 2))
    bins = np.linspace(0, settings.sampling_rate // 2, 1 + settings.n_fft // 2)
    offsets = centers[None, :] - bins[:, None]
    widths = np.diff(centers)
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    triangles *= 2.0 / (centers[2:] - centers[:-2])
    return np.ascontiguousarray(triangles, dtype=np.float32)


WHISPER = WhisperFeatures()
"""The defaults: 80 bins, 30 s chunks at 16 kHz (Whisper up to large-v2)."""


def fit_chunk(samples: NDArray[np.float32], settings: WhisperFeatures) -> NDArray[np.float32]:
    """The first chunk_length seconds, padded with padding_value where the audio is shorter."""
    chunk = np.full(settings.n_samples, settings.padding_value, dtype=np.float32)
    kept = samples[: settings.n_samples]
    chunk[: len(kept)] = kept
    return chunk


def log_mel(
    samples: NDArray[np.float32], settings: WhisperFeatures = WHISPER
) -> tuple[NDArray[np.float32], int]:
    """([feature_size, frames] float32 features, the count of frames that hold audio) for mono
    samples at settings.sampling_rate; frames past the count see only padding."""
    if samples.ndim != 1:
        raise ValueError(f"samples must be mono [samples], got shape {samples.shape}")
    waveform = torch.from_numpy(fit_chunk(samples, settings))
    spectrum = torch.stft(
        waveform,
        settings.n_fft,
        settings.hop_length,
        window=torch.hann_window(settings.n_fft),
        return_complex=True,
    )
    # The centered STFT has one frame more than the chunk holds hops; Whisper drops it.
    power = spectrum[:, :-1].abs() ** 2
    mel = torch.from_numpy(mel_filters(settings)).T @ power
    logs = torch.clamp(mel, min=LOG_FLOOR).log10()
    logs = torch.maximum(logs, logs.max() - DYNAMIC_RANGE)
    features = ((logs + 4.0) / 4.0).numpy()
    valid = math.ceil(min(len(samples), settings.n_samples) / settings.hop_length)
    return features, valid
