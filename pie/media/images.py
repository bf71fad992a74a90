"""Decoding images (PNG, JPEG, GIF, WebP) from bytes to RGB pixels with pillow, and the frames
of GIF and animated WebP files for use as video, within the [media] limits."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from attrs import frozen
from numpy.typing import NDArray
from PIL import Image, ImageOps, UnidentifiedImageError

from pie.config.media_section import DEFAULT_MEDIA_LIMITS, MediaConfig
from pie.media.errors import (
    CorruptMedia,
    MediaTooLarge,
    UnsupportedMedia,
    check_bytes,
    check_pixels,
    decoder_errors,
)
from pie.media.frames import (
    DecodedVideo,
    SampledFrame,
    frames_wanted,
    read_only,
    sampled_frame,
    uniform_indices,
)
from pie.media.sniff import describe

FORMATS = {"PNG": "png", "JPEG": "jpeg", "GIF": "gif", "WEBP": "webp"}
"""pillow's names of the formats decoded, and the names records give them."""
_ALLOWED = ("PNG", "JPEG", "GIF", "WebP")
_WHITE = (255, 255, 255, 255)
_GREY16_MODES = ("I", "I;16", "I;16B", "I;16L")
_DEFAULT_DELAY_MS = 100
"""An animation frame without a delay (or with 0) shows this long, as browsers do."""


@frozen(kw_only=True, eq=False)
class DecodedImage:
    pixels: NDArray[np.uint8]
    """RGB, [height, width, 3], read-only; upright (EXIF orientation applied)."""
    format: str
    """png, jpeg, gif or webp."""
    width: int
    height: int


def decode_image(data: bytes, limits: MediaConfig = DEFAULT_MEDIA_LIMITS) -> DecodedImage:
    """The image in `data` (an animation's first frame) as RGB, alpha over white."""
    check_bytes("image", data, key="max_image_mb", limit_mb=limits.max_image_mb)
    opened = _opened(data, "image", key="max_image_pixels", limit=limits.max_image_pixels)
    with decoder_errors("image"), opened as image:
        pixels = read_only(_rgb(ImageOps.exif_transpose(image)))
        kind = FORMATS[str(image.format)]
    height, width = pixels.shape[:2]
    return DecodedImage(pixels=pixels, format=kind, width=width, height=height)


def decode_animation(
    data: bytes, max_frames: int | None = None, limits: MediaConfig = DEFAULT_MEDIA_LIMITS
) -> DecodedVideo:
    """At most `max_frames` frames (default [media] video_frames) of a GIF or WebP (animated
    or not), evenly spaced by index, as a video: held to max_image_mb, max_animation_frames
    and, per frame, max_video_pixels."""
    wanted = frames_wanted(max_frames, limits)
    check_bytes("animation", data, key="max_image_mb", limit_mb=limits.max_image_mb)
    opened = _opened(data, "animation", key="max_video_pixels", limit=limits.max_video_pixels)
    with decoder_errors("animation"), opened as image:
        count = _frame_count(image, limits.max_animation_frames)
        frames, seconds = _walk(image, uniform_indices(count, wanted), limits)
        kind = FORMATS[str(image.format)]
    height, width = frames[0].pixels.shape[:2]
    return DecodedVideo(frames=frames, format=kind, width=width, height=height, seconds=seconds)


@contextmanager
def _opened(data: bytes, kind: str, *, key: str, limit: int) -> Iterator[Image.Image]:
    """The image's header read (not its pixels), as one of the allowed formats, and refused
    when its size is over `limit` pixels (the config's `key`)."""
    try:
        image = Image.open(io.BytesIO(data), formats=tuple(FORMATS))
    except UnidentifiedImageError as exc:
        detected = describe(data)
        if any(detected.startswith(name) for name in _ALLOWED):
            raise CorruptMedia(kind, f"{detected} whose header cannot be read") from exc
        raise UnsupportedMedia(kind, detected=detected, allowed=_ALLOWED) from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # pillow checks its own process-wide limit while opening, before ours can run. The
        # config keeps ours at or below it, so an image pillow refuses is over ours too.
        seen = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = int(seen.group(1)) if seen else 0
        raise MediaTooLarge(kind, key=key, limit=limit, value=pixels, unit="pixels") from exc
    with image:
        check_pixels(kind, *image.size, key=key, limit=limit)
        yield image


def _frame_count(image: Image.Image, limit: int) -> int:
    # GIF counts its frames by reading their headers only; WebP reads its count from the header.
    count = int(getattr(image, "n_frames", 1))
    if count > limit:
        raise MediaTooLarge(
            "animation", key="max_animation_frames", limit=limit, value=count, unit="frames"
        )
    return count


def _walk(
    image: Image.Image, indices: tuple[int, ...], limits: MediaConfig
) -> tuple[tuple[SampledFrame, ...], float]:
    """The frames at `indices` and the animation's length, stepping through every frame
    (each one builds on the one before)."""
    wanted, frames, elapsed_ms = set(indices), [], 0
    for index in range(getattr(image, "n_frames", 1)):
        image.seek(index)
        image.load()  # WebP reads a frame's delay as it decodes it
        if index in wanted:
            check_pixels(
                "animation", *image.size, key="max_video_pixels", limit=limits.max_video_pixels
            )
            frames.append(sampled_frame(_rgb(image), elapsed_ms / 1000))
        elapsed_ms += int(image.info.get("duration") or _DEFAULT_DELAY_MS)
    return tuple(frames), elapsed_ms / 1000


def _rgb(image: Image.Image) -> NDArray[np.uint8]:
    """[height, width, 3] uint8: transparency composited on white, 16-bit grey cut to 8 bits."""
    if image.mode in _GREY16_MODES:
        grey = (np.asarray(image).astype(np.int64).clip(0, 65535) >> 8).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if image.has_transparency_data:
        white = Image.new("RGBA", image.size, _WHITE)
        image = Image.alpha_composite(white, image.convert("RGBA"))
    return np.asarray(image.convert("RGB"), dtype=np.uint8)
