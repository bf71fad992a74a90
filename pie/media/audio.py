"""Decoding audio from bytes with av (WAV, FLAC, Ogg Vorbis and Opus, MP3, AAC...) to mono
float32 samples at the rate a model asks for, within the [media] limits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from attrs import frozen
from numpy.typing import NDArray

from pie.config.media_section import DEFAULT_MEDIA_LIMITS, MediaConfig
from pie.media.containers import first_stream, open_container, stated_seconds
from pie.media.errors import MediaTooLarge, check_bytes, decoder_errors

if TYPE_CHECKING:
    import av
    from av.audio.stream import AudioStream
    from av.container import InputContainer

CONTAINERS = ("wav", "flac", "ogg", "mp3", "aac", "aiff", "matroska", "webm", "mov", "mp4")
"""av's demuxers audio may come in (mov/mp4 hold .m4a files)."""
CODECS = ("pcm_*", "flac", "vorbis", "opus", "mp3", "aac", "alac")


@frozen(kw_only=True, eq=False)
class DecodedAudio:
    samples: NDArray[np.float32]
    """Mono, [samples], read-only: the channels' mean, nominally in [-1, 1]."""
    rate: int
    """Samples a second."""
    seconds: float
    format: str
    """av's demuxer name (wav, flac, ogg, mp3...)."""
    codec: str


def decode_audio(
    data: bytes, rate: int, limits: MediaConfig = DEFAULT_MEDIA_LIMITS
) -> DecodedAudio:
    """The first audio stream, mixed down to mono and resampled to `rate` samples a second."""
    if rate < 1:
        raise ValueError(f"rate must be at least 1, got {rate}")
    check_bytes("audio", data, key="max_audio_mb", limit_mb=limits.max_audio_mb)
    with decoder_errors("audio"), open_container(data, "audio", CONTAINERS) as container:
        stream = first_stream(container.streams.audio, container, "audio", CODECS)
        _check_seconds(stated_seconds(container, stream) or 0.0, limits)
        chunks = list(_resampled(container, stream, rate, limits))
        kind, codec = container.format.name, stream.codec_context.codec.canonical_name
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    samples.flags.writeable = False
    return DecodedAudio(
        samples=samples, rate=rate, seconds=len(samples) / rate, format=kind, codec=codec
    )


def _resampled(
    container: InputContainer, stream: AudioStream, rate: int, limits: MediaConfig
) -> Iterator[NDArray[np.float32]]:
    """Mono float32 pieces at `rate`, the length checked on the decoded samples as they come
    (a header may state a wrong length, or none)."""
    # The resampler keeps the channels: ffmpeg's own downmix to mono adds them at -3 dB
    # (a sine in both channels comes out 1.41 times louder), not their mean.
    import av

    resampler = av.AudioResampler(format="fltp", rate=rate)
    decoded = 0.0
    for frame in container.decode(stream):
        decoded += frame.samples / (frame.sample_rate or rate)
        _check_seconds(decoded, limits)
        for out in resampler.resample(frame):
            yield _mono(out)
    for out in resampler.resample(None):
        yield _mono(out)


def _mono(frame: av.AudioFrame) -> NDArray[np.float32]:
    planes = frame.to_ndarray()
    return np.asarray(planes.mean(axis=0), dtype=np.float32)


def _check_seconds(seconds: float, limits: MediaConfig) -> None:
    limit = limits.max_audio_seconds
    if seconds > limit:
        raise MediaTooLarge(
            "audio", key="max_audio_seconds", limit=limit, value=round(seconds, 3), unit="seconds"
        )
