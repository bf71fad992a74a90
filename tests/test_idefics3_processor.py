"""Idefics3/SmolVLM preprocessing owned by pie against transformers' Idefics3 PIL image processor
(the one that works without torchvision): pixel values bit for bit and the crop grid, for
pictures that split into several crops, one that does not split and the unsplit setting; and
the prompt text a picture becomes against the Idefics3 and SmolVLM processors'."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers import Idefics3ImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from pie.media.idefics3 import (
    FAKE_TOKEN,
    GLOBAL_TOKEN,
    IMAGE_TOKEN,
    Idefics3Vision,
    image_prompt,
    preprocess_image,
)

SMALL: dict[str, Any] = dict(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})
SETTINGS: dict[str, dict[str, Any]] = {
    "small-split": SMALL,
    "small-unsplit": {**SMALL, "do_image_splitting": False},
    "small-bicubic-imagenet": {
        **SMALL,
        "resample": int(Image.Resampling.BICUBIC),
        "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225],
    },
    "small-no-first-resize": {**SMALL, "do_resize": False},
}
SIZES = [(50, 80), (200, 70), (33, 33), (5, 300), (32, 32), (1, 1)]
"""(height, width): wide and tall pictures that split into a grid, a thin one, one exactly a
crop, a single pixel."""


def reference(pixels: np.ndarray, settings: dict[str, Any]) -> tuple[np.ndarray, int, int]:
    processor = Idefics3ImageProcessorPil(**settings)
    out = processor.preprocess(images=[Image.fromarray(pixels)], return_row_col_info=True)
    return np.asarray(out["pixel_values"][0]), out["rows"][0][0], out["cols"][0][0]


def random_picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def processor_config(settings: dict[str, Any]) -> dict[str, Any]:
    """What save_pretrained writes to preprocessor_config.json for these settings."""
    return Idefics3ImageProcessorPil(**settings).to_dict()


@pytest.mark.unit
@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_crops_equal_transformers_bit_for_bit(name: str, size: tuple[int, int]) -> None:
    settings = SETTINGS[name]
    pixels = random_picture(*size)
    expected, rows, cols = reference(pixels, settings)
    crops = preprocess_image(
        pixels, Idefics3Vision.from_preprocessor_config(processor_config(settings))
    )
    assert (crops.rows, crops.cols) == (rows, cols)
    assert crops.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(crops.pixel_values, expected)


@pytest.mark.unit
def test_a_wide_picture_splits_into_a_grid_then_the_whole() -> None:
    crops = preprocess_image(random_picture(50, 80), Idefics3Vision.from_preprocessor_config(SMALL))
    # Longest edge 96 -> 96 x 60, then 96 x 64: two rows of three 32-pixel crops, plus the whole.
    assert (crops.rows, crops.cols, crops.count) == (2, 3, 7)
    assert crops.pixel_values.shape == (7, 3, 32, 32)


@pytest.mark.unit
def test_default_settings_equal_transformers() -> None:
    """transformers' defaults (longest edge 1456, 364-pixel crops) when the config is empty."""
    pixels = random_picture(300, 400, seed=1)
    expected, rows, cols = reference(pixels, {})
    crops = preprocess_image(pixels, Idefics3Vision.from_preprocessor_config({}))
    assert (crops.rows, crops.cols) == (rows, cols) == (3, 4)
    np.testing.assert_array_equal(crops.pixel_values, expected)


@pytest.mark.unit
@pytest.mark.parametrize("grid", [(0, 0), (1, 2), (3, 4)])
def test_prompt_equals_the_processors(grid: tuple[int, int]) -> None:
    rows, cols = grid
    run = IMAGE_TOKEN * 5
    expected = get_image_prompt_string(rows, cols, 5, FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN)
    assert image_prompt(rows, cols, run) == expected


@pytest.mark.unit
def test_settings_that_cannot_be_read_are_refused() -> None:
    with pytest.raises(ValueError, match="longest_edge"):
        Idefics3Vision.from_preprocessor_config({"size": {"height": 32, "width": 32}})
    config = Idefics3Vision.from_preprocessor_config(SMALL)
    with pytest.raises(ValueError, match="RGB uint8"):
        preprocess_image(np.zeros((4, 4), np.uint8), config)
    with pytest.raises(ValueError, match="at least one pixel"):
        preprocess_image(np.zeros((0, 4, 3), np.uint8), config)
