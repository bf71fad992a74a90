"""Qwen2-VL's (and Qwen2.5-VL's) image and video preprocessing: decoded RGB pixels resized to a
multiple of the merged patch size, normalized and cut into the flat patch rows its vision
encoder reads, as transformers' Qwen2-VL processors give them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from attrs import field, frozen
from numpy.typing import NDArray
from PIL import Image

from pie.media.errors import MediaError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
"""A picture longer than this many times its width (or the reverse) is refused."""


class ExtremeAspectRatio(MediaError):
    """A picture too long and thin for the model: its patch grid would be one patch wide."""

    def __init__(self, height: int, width: int) -> None:
        ratio = max(height, width) / min(height, width)
        super().__init__(
            f"image {width}x{height} has aspect ratio {ratio:.1f}, over {MAX_ASPECT_RATIO}"
        )
        self.height, self.width = height, width


@frozen(kw_only=True)
class Qwen2VLVision:
    """The settings of a Qwen2-VL image or video processor (`preprocessor_config.json` or
    `video_preprocessor_config.json`); the defaults are the image processor's."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = field(default=CLIP_MEAN, converter=tuple)
    std: tuple[float, float, float] = field(default=CLIP_STD, converter=tuple)

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> Qwen2VLVision:
        """Reads the keys transformers reads: `min_pixels`/`max_pixels`, which win over the
        newer `size: {shortest_edge, longest_edge}`, and the rest by their own names."""
        size = config.get("size") or {}
        defaults = cls()
        return cls(
            patch_size=config.get("patch_size", defaults.patch_size),
            temporal_patch_size=config.get("temporal_patch_size", defaults.temporal_patch_size),
            merge_size=config.get("merge_size", defaults.merge_size),
            min_pixels=config.get("min_pixels") or size.get("shortest_edge", defaults.min_pixels),
            max_pixels=config.get("max_pixels") or size.get("longest_edge", defaults.max_pixels),
            mean=config.get("image_mean", defaults.mean),
            std=config.get("image_std", defaults.std),
        )

    @property
    def factor(self) -> int:
        """Both sides of a resized picture are multiples of this: one merged patch."""
        return self.patch_size * self.merge_size


@frozen(kw_only=True, eq=False)
class VisionPatches:
    pixel_values: NDArray[np.float32]
    """[grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size**2]: one row per
    patch, the patches of each merge_size x merge_size block consecutive."""
    grid_thw: tuple[int, int, int]
    """Patches in time, height and width."""
    tokens: int
    """Soft tokens the language model sees: one per merged block."""


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """The (height, width) Qwen2-VL resizes a picture to: each side rounded to a multiple of
    `factor`, then both scaled by one ratio (down to a multiple, or up) when the area falls
    outside [min_pixels, max_pixels], keeping the aspect ratio as nearly as the rounding lets."""
    if min(height, width) < 1:
        raise ValueError(f"an image needs at least one pixel each way, got {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ExtremeAspectRatio(height, width)
    # Python's round (half to even), as the reference rounds.
    new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
    if new_height * new_width > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / shrink / factor) * factor)
        new_width = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_height * new_width < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * grow / factor) * factor
        new_width = math.ceil(width * grow / factor) * factor
    return new_height, new_width


def preprocess_image(image_rgb: NDArray[np.uint8], config: Qwen2VLVision) -> VisionPatches:
    """One RGB uint8 picture [height, width, 3] as patches, repeated in time to fill a
    temporal patch: pillow's bicubic resize on the uint8 pixels, as transformers' PIL image
    processor does, then x / 255 and (x - mean) / std in float32."""
    height, width = _checked_rgb(image_rgb).shape[:2]
    size = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    resized = np.asarray(
        Image.fromarray(image_rgb).resize((size[1], size[0]), Image.Resampling.BICUBIC)
    )
    # One flat table, each channel's 256 values after the last's: an index per subpixel.
    levels = resized.astype(np.uint16) + np.array([0, 256, 512], np.uint16)
    normalized = np.take(_normalizer(config).T.ravel(), levels)
    frames = np.broadcast_to(normalized, (config.temporal_patch_size, *normalized.shape))
    return _patches(frames, config)


def preprocess_video(frames: Sequence[NDArray[np.uint8]], config: Qwen2VLVision) -> VisionPatches:
    """Frames (RGB uint8, all one size) as patches, consecutive pairs (temporal_patch_size) in
    time, an odd last one paired with itself: as transformers' Qwen2-VL video processor on the
    CPU, which resizes with torch's antialiased bicubic on uint8 (within one level of pillow's)
    and normalizes as (x - 255 mean) / (255 std)."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    shapes = {_checked_rgb(frame).shape for frame in frames}
    if len(shapes) > 1:
        raise ValueError(f"a video's frames must share one size, got {sorted(shapes)}")
    height, width = next(iter(shapes))[:2]
    size = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)
    if size != (height, width):
        video = torch.nn.functional.interpolate(
            video, size=size, mode="bicubic", align_corners=False, antialias=True
        )
    mean = torch.tensor(config.mean).view(-1, 1, 1) * 255.0
    std = torch.tensor(config.std).view(-1, 1, 1) * 255.0
    normalized = ((video.to(torch.float32) - mean) / std).permute(0, 2, 3, 1).numpy()
    pad = -len(frames) % config.temporal_patch_size
    if pad:
        normalized = np.concatenate([normalized, np.repeat(normalized[-1:], pad, axis=0)])
    return _patches(normalized, config)


def _checked_rgb(pixels: NDArray[np.uint8]) -> NDArray[np.uint8]:
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(
            f"expected RGB uint8 [height, width, 3], got {pixels.dtype} {pixels.shape}"
        )
    return pixels


def _normalizer(config: Qwen2VLVision) -> NDArray[np.float32]:
    """[256, 3]: each channel's normalized value for each uint8 level, computed as the
    reference computes it (x / 255 in float64 to float32, then float32 arithmetic), so a
    lookup gives its values bit for bit."""
    levels = (np.arange(256, dtype=np.float64)[:, None] * (1 / 255)).astype(np.float32)
    mean, std = np.asarray(config.mean, np.float32), np.asarray(config.std, np.float32)
    return (levels - mean) / std


def _patches(frames: NDArray[np.float32], config: Qwen2VLVision) -> VisionPatches:
    """[frames, height, width, channels] (frames a multiple of temporal_patch_size) as patch
    rows: blocks in time, then merged blocks row by row, then the patches within a block row
    by row; each row channel-major, then time, then the patch's pixels row by row."""
    count, height, width, channels = frames.shape
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_t, grid_h, grid_w = count // tp, height // p, width // p
    blocks = frames.reshape(grid_t, tp, grid_h // m, m, p, grid_w // m, m, p, channels)
    # (t, block row, block col, row in block, col in block, channel, time, pixel row, pixel col)
    ordered = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    rows = np.ascontiguousarray(ordered).reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
    return VisionPatches(
        pixel_values=rows,
        grid_thw=(grid_t, grid_h, grid_w),
        tokens=grid_t * grid_h * grid_w // (m * m),
    )
