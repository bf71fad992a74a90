"""The record of a video or animation decoded to a few frames, and which frames to keep:
evenly spaced across the whole, the first and the last included."""

from __future__ import annotations

import numpy as np
from attrs import frozen
from numpy.typing import NDArray

from pie.config.media_section import MediaConfig
from pie.media.errors import MediaTooLarge


@frozen(kw_only=True, eq=False)
class SampledFrame:
    pixels: NDArray[np.uint8]
    """RGB, [height, width, 3], read-only."""
    seconds: float
    """When the frame shows, from the first frame's time."""
    marker: str
    """`seconds` as "mm:ss", the form models' prompts mark frames with."""


@frozen(kw_only=True, eq=False)
class DecodedVideo:
    frames: tuple[SampledFrame, ...]
    format: str
    """The container (av's demuxer name) or, for an animation, the image format."""
    width: int
    height: int
    seconds: float
    """The whole video's length, from its metadata or measured."""


def frames_wanted(max_frames: int | None, limits: MediaConfig) -> int:
    """How many frames to sample: `max_frames`, else [media] video_frames, at most
    max_video_frames."""
    wanted = limits.video_frames if max_frames is None else max_frames
    if wanted < 1:
        raise ValueError(f"max_frames must be at least 1, got {wanted}")
    if wanted > limits.max_video_frames:
        limit = limits.max_video_frames
        raise MediaTooLarge(
            "video", key="max_video_frames", limit=limit, value=wanted, unit="frames asked for"
        )
    return wanted


def sampled_frame(pixels: NDArray[np.uint8], seconds: float) -> SampledFrame:
    return SampledFrame(pixels=read_only(pixels), seconds=seconds, marker=marker(seconds))


def marker(seconds: float) -> str:
    """ "mm:ss" (minutes past 59 keep counting: 75:03)."""
    whole = max(0, int(seconds))
    return f"{whole // 60:02d}:{whole % 60:02d}"


def uniform_indices(count: int, n: int) -> tuple[int, ...]:
    """At most `n` of `count` indices, evenly spaced, the first and (for n >= 2) the last."""
    if count <= n:
        return tuple(range(count))
    if n == 1:
        return (0,)
    return tuple(round(i * (count - 1) / (n - 1)) for i in range(n))


def uniform_times(last: float, n: int) -> tuple[float, ...]:
    """`n` times evenly spaced from 0 to `last`."""
    if n == 1:
        return (0.0,)
    return tuple(i * last / (n - 1) for i in range(n))


def read_only(pixels: NDArray[np.uint8]) -> NDArray[np.uint8]:
    array = np.ascontiguousarray(pixels, dtype=np.uint8)
    array.flags.writeable = False
    return array
