"""Idefics3's (and SmolVLM's) image preprocessing: decoded RGB pixels resized, cut into square
crops of the vision encoder's size plus the whole picture, normalised as transformers' Idefics3
PIL image processor gives them; and the prompt text each picture becomes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from attrs import field, frozen
from numpy.typing import NDArray
from PIL import Image

MAX_IMAGE_SIZE = 4096
"""Neither side of the first resize exceeds this (the reference's absolute bound)."""
IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"


@frozen(kw_only=True)
class Idefics3Vision:
    """The settings of an Idefics3 image processor (`preprocessor_config.json`); the defaults
    are transformers'."""

    do_resize: bool = True
    longest_edge: int = 4 * 364
    """`size.longest_edge`: the first resize brings the longer side to this."""
    do_image_splitting: bool = True
    crop_size: int = 364
    """`max_image_size.longest_edge`: the side of every square crop the encoder reads."""
    resample: int = int(Image.Resampling.LANCZOS)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, float, float] = field(default=(0.5, 0.5, 0.5), converter=tuple)
    std: tuple[float, float, float] = field(default=(0.5, 0.5, 0.5), converter=tuple)

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> Idefics3Vision:
        """Reads the keys transformers reads; a `size` other than {longest_edge} is refused."""
        defaults = cls()
        size = config.get("size") or {"longest_edge": defaults.longest_edge}
        if "longest_edge" not in size:
            raise ValueError(f"image processor size {size} has no longest_edge")
        crop = config.get("max_image_size") or {"longest_edge": defaults.crop_size}
        return cls(
            do_resize=config.get("do_resize", defaults.do_resize),
            longest_edge=size["longest_edge"],
            do_image_splitting=config.get("do_image_splitting", defaults.do_image_splitting),
            crop_size=crop["longest_edge"],
            resample=config.get("resample", defaults.resample),
            do_rescale=config.get("do_rescale", defaults.do_rescale),
            rescale_factor=config.get("rescale_factor", defaults.rescale_factor),
            do_normalize=config.get("do_normalize", defaults.do_normalize),
            mean=config.get("image_mean", defaults.mean),
            std=config.get("image_std", defaults.std),
        )


@frozen(kw_only=True, eq=False)
class Idefics3Crops:
    pixel_values: NDArray[np.float32]
    """[crops, 3, crop_size, crop_size]: the grid's crops row by row, then the whole picture
    (or the whole picture alone)."""
    rows: int
    cols: int
    """The crop grid; both 0 when the picture is one crop, as the reference reports it."""

    @property
    def count(self) -> int:
        return int(self.pixel_values.shape[0])


def longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """(height, width) with the longer side brought to `longest_edge` (up or down), the other
    truncated and then made even, both at least 1; then held under MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = longest_edge, int(longest_edge / aspect)
        height += height % 2
    else:
        height, width = longest_edge, int(longest_edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def crop_grid_size(height: int, width: int, crop: int) -> tuple[int, int]:
    """(height, width) as whole multiples of `crop`: the longer side rounded up, the other taken
    from the aspect ratio and rounded up."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / crop) * crop
        height = math.ceil(int(width / aspect) / crop) * crop
    else:
        height = math.ceil(height / crop) * crop
        width = math.ceil(int(height * aspect) / crop) * crop
    return height, width


def preprocess_image(image_rgb: NDArray[np.uint8], config: Idefics3Vision) -> Idefics3Crops:
    """One RGB uint8 picture [height, width, 3] as crops: pillow resizes on the uint8 pixels
    (the reference's PIL backend), then rescale and normalisation in float32."""
    image = Image.fromarray(_checked_rgb(image_rgb))
    if config.do_resize:
        height, width = longest_edge_size(image.height, image.width, config.longest_edge)
        image = _resized(image, height, width, config)
    rows = cols = 0
    if not config.do_image_splitting:
        crops = [_resized(image, config.crop_size, config.crop_size, config)]
    else:
        image = _resized(
            image, *crop_grid_size(image.height, image.width, config.crop_size), config
        )
        crops, rows, cols = _split(image, config)
    table = _level_table(config)
    pixels = np.stack([np.take(table, _levels(crop)) for crop in crops])
    return Idefics3Crops(pixel_values=pixels.transpose(0, 3, 1, 2).copy(), rows=rows, cols=cols)


def image_prompt(rows: int, cols: int, image_run: str) -> str:
    """The text a picture of `rows` x `cols` crops becomes (0 x 0: one crop), with `image_run`
    standing for each crop's image tokens."""
    whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{image_run}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return whole
    grid = "".join(
        "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{image_run}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{whole}"


def _split(image: Image.Image, config: Idefics3Vision) -> tuple[list[Image.Image], int, int]:
    """The crops of a picture whose sides are multiples of crop_size, row by row, then the
    whole picture shrunk to one crop; a picture of one crop is kept alone."""
    side = config.crop_size
    if image.height <= side and image.width <= side:
        return [image], 0, 0
    rows, cols = image.height // side, image.width // side
    crops = [
        image.crop((c * side, r * side, (c + 1) * side, (r + 1) * side))
        for r in range(rows)
        for c in range(cols)
    ]
    return [*crops, _resized(image, side, side, config)], rows, cols


def _resized(image: Image.Image, height: int, width: int, config: Idefics3Vision) -> Image.Image:
    return image.resize((width, height), Image.Resampling(config.resample))


def _checked_rgb(pixels: NDArray[np.uint8]) -> NDArray[np.uint8]:
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(
            f"expected RGB uint8 [height, width, 3], got {pixels.dtype} {pixels.shape}"
        )
    if min(pixels.shape[:2]) < 1:
        raise ValueError(f"an image needs at least one pixel each way, got {pixels.shape[:2]}")
    return pixels


def _levels(crop: Image.Image) -> NDArray[np.uint16]:
    """[height, width, 3]: each subpixel's index into the flattened level table."""
    return np.asarray(crop).astype(np.uint16) * 3 + np.array([0, 1, 2], np.uint16)


def _level_table(config: Idefics3Vision) -> NDArray[np.float32]:
    """[256 * 3]: each uint8 level's value per channel (level-major), computed as the reference
    computes it (the rescale in float64 cast to float32, then float32 arithmetic), so a lookup
    gives its values bit for bit."""
    levels = np.arange(256, dtype=np.float64)[:, None]
    values = (levels * config.rescale_factor if config.do_rescale else levels).astype(np.float32)
    if config.do_normalize:
        mean, std = np.asarray(config.mean, np.float32), np.asarray(config.std, np.float32)
        values = (values - mean) / std
    return np.broadcast_to(values, (256, 3)).ravel()
