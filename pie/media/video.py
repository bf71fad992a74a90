"""Decoding a video from bytes with av to a few RGB frames evenly spaced across its length,
within the [media] limits. GIF and WebP animations sent as video go to the image decoder."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from pie.config.media_section import DEFAULT_MEDIA_LIMITS, MediaConfig
from pie.media.containers import first_stream, open_container, stated_seconds
from pie.media.errors import CorruptMedia, MediaTooLarge, check_bytes, check_pixels, decoder_errors
from pie.media.frames import DecodedVideo, frames_wanted, sampled_frame, uniform_times
from pie.media.images import decode_animation
from pie.media.sniff import is_animated_image_format

if TYPE_CHECKING:
    from av.container import InputContainer
    from av.video.frame import VideoFrame
    from av.video.stream import VideoStream

CONTAINERS = ("mov", "mp4", "matroska", "webm", "avi", "mpegts", "mpeg", "ogg", "flv", "m4v")
"""av's demuxers a video may come in; also the raw streams below."""
RAW_STREAMS = ("h264", "hevc")
CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg1video", "mpeg2video", "mjpeg")
_MAX_RATE = 240
"""Frames a second a video may average: a stream whose timestamps are missing or stand still
still stops after max_video_seconds times this many frames."""
_GUESSED_RATE = 25.0
"""ffmpeg's own guess for a stream that states no rate."""


def decode_video(
    data: bytes, max_frames: int | None = None, limits: MediaConfig = DEFAULT_MEDIA_LIMITS
) -> DecodedVideo:
    """At most `max_frames` frames (default [media] video_frames) of the first video stream,
    evenly spaced in time, the first and (for two or more) the last included."""
    wanted = frames_wanted(max_frames, limits)
    check_bytes("video", data, key="max_video_mb", limit_mb=limits.max_video_mb)
    if is_animated_image_format(data):
        return decode_animation(data, wanted, limits)
    with decoder_errors("video"):
        seconds, last = _timeline(data, limits)
        with open_container(data, "video", CONTAINERS + RAW_STREAMS) as container:
            stream = first_stream(container.streams.video, container, "video", CODECS)
            picks = _pick(_decoded(container, stream, limits), uniform_times(last, wanted))
            frames = tuple(sampled_frame(_rgb(f), t) for t, f in picks)
            kind = container.format.name
    height, width = frames[0].pixels.shape[:2]
    return DecodedVideo(frames=frames, format=kind, width=width, height=height, seconds=seconds)


def _timeline(data: bytes, limits: MediaConfig) -> tuple[float, float]:
    """The video's length (stated, else measured) and when its last frame starts, from the
    first frame's time: read from its packets without decoding them, and refused over the
    limits, as is a first frame over max_video_pixels."""
    with open_container(data, "video", CONTAINERS + RAW_STREAMS) as container:
        stream = first_stream(container.streams.video, container, "video", CODECS)
        _check_frame(stream.codec_context.width, stream.codec_context.height, limits)
        stated = stated_seconds(container, stream)
        if stated is not None:
            _check_length(stated, 0, limits)
        first, last, end = _packet_times(container, stream, limits)
    return (end - first if stated is None else stated), last - first


def _packet_times(
    container: InputContainer, stream: VideoStream, limits: MediaConfig
) -> tuple[float, float, float]:
    """When the first and the last frame start and when the last one ends, from the packets'
    timestamps (a stream without them counts frames at its rate)."""
    first, last, end, rate = float("inf"), 0.0, 0.0, _rate(stream)
    count = 0
    for packet in container.demux(stream):
        if packet.size == 0:
            continue  # the empty packet that ends a demux
        if packet.pts is not None and packet.time_base is not None:
            start = float(packet.pts * packet.time_base)
            stop = start + float((packet.duration or 0) * packet.time_base)
        else:
            start, stop = count / rate, (count + 1) / rate
        first, last, end, count = min(first, start), max(last, start), max(end, stop), count + 1
        _check_length(end - first, count, limits)
    if count == 0:
        raise CorruptMedia("video", "the video stream holds no frames")
    return first, last, end


def _decoded(
    container: InputContainer, stream: VideoStream, limits: MediaConfig
) -> Iterator[tuple[float, VideoFrame]]:
    """Every frame with its time from the first frame's, checked against the limits as it
    comes, whatever the metadata said."""
    first, rate = None, _rate(stream)
    for index, frame in enumerate(container.decode(stream)):
        _check_frame(frame.width, frame.height, limits)
        seconds = float(frame.time) if frame.time is not None else index / rate
        first = seconds if first is None else first
        _check_length(seconds - first, index + 1, limits)
        yield seconds - first, frame


def _pick(
    frames: Iterator[tuple[float, VideoFrame]], targets: Sequence[float]
) -> list[tuple[float, VideoFrame]]:
    """The frame nearest each target time (the earlier on a tie), holding only the frame
    before the current one; with two or more targets the last is the last frame. A frame
    nearest to several targets is kept once."""
    inner = targets[:-1] if len(targets) >= 2 else targets
    picks: list[tuple[float, VideoFrame]] = []
    before: tuple[float, VideoFrame] | None = None
    for seconds, frame in frames:
        while len(picks) < len(inner) and inner[len(picks)] <= seconds:
            target = inner[len(picks)]
            nearer = before if before and target - before[0] <= seconds - target else None
            picks.append(nearer or (seconds, frame))
        before = (seconds, frame)
    if before is None:
        raise CorruptMedia("video", "no frame could be decoded")
    picks += [before] * (len(targets) - len(picks))
    return [pick for i, pick in enumerate(picks) if i == 0 or pick[1] is not picks[i - 1][1]]


def _rgb(frame: VideoFrame) -> NDArray[np.uint8]:
    return np.asarray(frame.to_ndarray(format="rgb24"), dtype=np.uint8)


def _rate(stream: VideoStream) -> float:
    return float(stream.average_rate) if stream.average_rate else _GUESSED_RATE


def _check_frame(width: int, height: int, limits: MediaConfig) -> None:
    check_pixels("video", width, height, key="max_video_pixels", limit=limits.max_video_pixels)


def _check_length(seconds: float, frames: int, limits: MediaConfig) -> None:
    limit = limits.max_video_seconds
    if seconds > limit:
        raise MediaTooLarge(
            "video", key="max_video_seconds", limit=limit, value=round(seconds, 3), unit="seconds"
        )
    if frames > limit * _MAX_RATE:
        raise MediaTooLarge(
            "video",
            key="max_video_seconds",
            limit=limit,
            value=frames,
            unit=f"frames (at most {_MAX_RATE} a second)",
        )
