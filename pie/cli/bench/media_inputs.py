"""Encoded media for `pie bench media`, made in memory from a seed: photo-like JPEG pictures
(smooth colour fields with a little grain), a FLAC clip of a chord and an MP4 video."""

from __future__ import annotations

import io

import av
import numpy as np
from av.video.stream import VideoStream
from numpy.typing import NDArray
from PIL import Image

VIDEO_FPS = 8


def picture(seed: int, width: int, height: int) -> NDArray[np.uint8]:
    """RGB pixels [height, width, 3]: three seeded waves per channel plus grain, so that JPEG
    compresses them about as it compresses a photograph."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(0.002, 0.02, 2).tolist() + [rng.uniform(0, 6.3)]
        channels.append(127 + 90 * np.sin(fx * x + fy * y + phase))
    grain = rng.normal(0, 6, (height, width, 3))
    return np.clip(np.stack(channels, axis=-1) + grain, 0, 255).astype(np.uint8)


def jpeg(seed: int, width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(picture(seed, width, height)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def flac(seconds: float, rate: int = 44100) -> bytes:
    """A mono A-major chord at `rate` samples a second (the engine resamples it)."""
    t = np.arange(int(rate * seconds)) / rate
    chord = np.sin(2 * np.pi * np.outer([440.0, 554.37, 659.25], t)).sum(axis=0)
    samples = (0.25 * chord).astype(np.float32)[None, :]
    out = io.BytesIO()
    with av.open(out, "w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
        frame.sample_rate, frame.pts = rate, 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def mp4(frames: int, width: int, height: int) -> bytes:
    """`frames` pictures, one a frame at VIDEO_FPS, in H.264 (MPEG-4 part 2 where av lacks it)."""
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=VIDEO_FPS)
        assert isinstance(stream, VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            pixels = av.VideoFrame.from_ndarray(picture(i, width, height), format="rgb24")
            container.mux(stream.encode(pixels))
        container.mux(stream.encode())
    return out.getvalue()
