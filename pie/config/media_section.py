"""The [media] section: limits on the images, video and audio that programs and clients send
as encoded bytes and the engine decodes, and on the speech a speaking model produces
(docs/media.md)."""

from __future__ import annotations

from typing import Any

import attrs
from attrs import field, frozen

from pie.config.checks import at_least, positive

PILLOW_PIXELS = 89_478_485
"""pillow's own limit (Image.MAX_IMAGE_PIXELS): it warns past it and refuses past twice it
while reading a header, before the engine's limit is checked, so the pixel limits stay at or
below it."""


def _pixels(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not 1 <= value <= PILLOW_PIXELS:
        raise ValueError(f"media.{attribute.name} must be in [1, {PILLOW_PIXELS}], got {value}")


@frozen(kw_only=True)
class MediaConfig:
    """Every limit is checked before the work it bounds where the header says enough (bytes,
    pixels, a stated duration or frame count), and again while decoding, so a header that
    lies or says nothing still stops at the limit."""

    max_image_mb: int = field(default=20, validator=at_least(1))
    """The largest encoded image (PNG, JPEG, GIF, WebP), in MiB."""
    max_image_pixels: int = field(default=7680 * 4320, validator=_pixels)
    """Width times height of an image, checked from its header before its pixels are decoded:
    8K UHD (7680x4320, about 33 Mpx, 100 MB as RGB), above any camera's or screen's usual
    output and far below what would exhaust memory."""
    max_animation_frames: int = field(default=500, validator=at_least(1))
    """Frames a GIF or animated WebP sent as video may have (each one is decoded, since each
    builds on the one before)."""
    max_video_mb: int = field(default=128, validator=at_least(1))
    """The largest encoded video, in MiB."""
    max_video_seconds: float = field(default=300.0, validator=positive)
    """The longest video; every frame up to its end is decoded to sample a few."""
    video_frames: int = field(default=16, validator=at_least(1))
    """Frames sampled from a video when the request does not say how many."""
    max_video_frames: int = field(default=64, validator=at_least(1))
    """The most frames a request may ask to sample from one video."""
    max_video_pixels: int = field(default=3840 * 2160, validator=_pixels)
    """Width times height of one video or animation frame: 4K UHD (about 8.3 Mpx)."""
    max_audio_mb: int = field(default=64, validator=at_least(1))
    """The largest encoded audio, in MiB (about 6 minutes of CD-quality WAV)."""
    max_audio_seconds: float = field(default=600.0, validator=positive)
    """The longest audio, counted in decoded samples."""
    max_items_per_inferlet: int = field(default=64, validator=at_least(1))
    """Images, videos and clips one program may hold at once (each holds its decoded and
    prepared form until it is freed or the program ends)."""
    max_items_per_user: int = field(default=256, validator=at_least(1))
    """Images, videos and clips all of one user's programs may hold at once on one model."""
    encoder_cache_mb: int = field(default=256, validator=at_least(1))
    """Encoder outputs kept per model, by content hash, so that the same media in forks,
    snapshots and later requests is not encoded again; the least recently used go first."""
    speech_max_seconds: float = field(default=30.0, validator=positive)
    """The longest clip one speech request may ask for."""
    max_speech_per_inferlet: int = field(default=4, validator=at_least(1))
    """Speech requests in flight and clips held by one program at once (each request keeps its
    own KV until it ends, each clip its samples until freed)."""
    max_speech_per_user: int = field(default=16, validator=at_least(1))
    """The same, counted over all of one user's programs."""

    def __attrs_post_init__(self) -> None:
        if self.video_frames > self.max_video_frames:
            raise ValueError(
                f"media.video_frames ({self.video_frames}) must be at most "
                f"max_video_frames ({self.max_video_frames})"
            )


DEFAULT_MEDIA_LIMITS = MediaConfig()
"""The defaults, for decoders called without a config."""
