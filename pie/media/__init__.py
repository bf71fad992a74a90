"""Media from programs and clients, sent as encoded bytes and decoded by the engine: images to
RGB pixels, video to a few sampled frames, audio to mono samples, each within [media] limits."""

from __future__ import annotations

from pie.media.audio import DecodedAudio, decode_audio
from pie.media.errors import CorruptMedia, MediaError, MediaTooLarge, UnsupportedMedia
from pie.media.frames import DecodedVideo, SampledFrame
from pie.media.images import DecodedImage, decode_animation, decode_image
from pie.media.video import decode_video

__all__ = [
    "CorruptMedia",
    "DecodedAudio",
    "DecodedImage",
    "DecodedVideo",
    "MediaError",
    "MediaTooLarge",
    "SampledFrame",
    "UnsupportedMedia",
    "decode_animation",
    "decode_audio",
    "decode_image",
    "decode_video",
]
