"""Qwen2-VL preprocessing against transformers' PIL image processor on fresh random pictures.

Images must match bit for bit (asserted within 1e-5): the same pillow resize and the same
float32 arithmetic. transformers' Qwen2-VL video processor imports torchvision, which this
environment does not have, so video is checked against the image processor frame by frame:
exactly where the frames are already at the target size (no resize), and within one uint8
level of resizing (1 / 255 / min std) where torch's bicubic and pillow's may round apart."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from pie.media import decode_image
from pie.media.qwen2_vl import (
    CLIP_STD,
    ExtremeAspectRatio,
    Qwen2VLVision,
    preprocess_image,
    preprocess_video,
    smart_resize,
)

pytestmark = pytest.mark.unit

CONFIG = Qwen2VLVision(min_pixels=56 * 56, max_pixels=28 * 28 * 256)
TOLERANCE = 1e-5
ONE_LEVEL = 1 / 255 / min(CLIP_STD) + 1e-5


def reference(config: Qwen2VLVision = CONFIG) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size,
        image_mean=list(config.mean),
        image_std=list(config.std),
    )


def random_rgb(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("height", "width"),
    [
        (10, 13),  # under min_pixels: scaled up
        (28, 28),
        (42, 70),  # 1.5 and 2.5 patches: Python's half-to-even rounding
        (100, 150),
        (333, 777),
        (768, 1024),
        (2000, 1500),  # over max_pixels: scaled down
        (30, 3000),  # ratio 100: long and thin but allowed
    ],
)
def test_image_matches_transformers(height: int, width: int) -> None:
    pixels = random_rgb(np.random.default_rng(height * width), height, width)
    expected = reference()(images=pixels, return_tensors="np")
    mine = preprocess_image(pixels, CONFIG)
    assert mine.pixel_values.dtype == np.float32
    assert mine.pixel_values.shape == expected["pixel_values"].shape
    assert np.abs(mine.pixel_values - expected["pixel_values"]).max() <= TOLERANCE
    assert mine.grid_thw == tuple(expected["image_grid_thw"][0])
    grid_t, grid_h, grid_w = expected["image_grid_thw"][0]
    assert mine.tokens == grid_t * grid_h * grid_w // 4 == len(expected["pixel_values"]) // 4


def test_size_rule_keeps_its_bounds_and_factor() -> None:
    rng = np.random.default_rng(1)
    for _ in range(2000):
        height, width = (int(side) for side in rng.integers(1, 5000, 2))
        if max(height, width) / min(height, width) > 200:
            continue
        new_height, new_width = smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280)
        assert new_height % 28 == 0 and new_width % 28 == 0
        assert new_height * new_width <= 28 * 28 * 1280
        assert new_height * new_width >= 56 * 56
    assert smart_resize(768, 1024) == (756, 1036)
    assert smart_resize(10, 13) == (56, 84)


def test_extreme_aspect_ratio_is_refused() -> None:
    with pytest.raises(ExtremeAspectRatio, match=r"image 2020x10 has aspect ratio 202.0"):
        preprocess_image(np.zeros((10, 2020, 3), np.uint8), CONFIG)
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        reference()(images=np.zeros((10, 2020, 3), np.uint8), return_tensors="np")


def test_default_config_matches_the_default_processor() -> None:
    pixels = random_rgb(np.random.default_rng(2), 1100, 1300)
    expected = Qwen2VLImageProcessorPil()(images=pixels, return_tensors="np")
    mine = preprocess_image(pixels, Qwen2VLVision())
    assert mine.grid_thw == tuple(expected["image_grid_thw"][0])
    assert np.abs(mine.pixel_values - expected["pixel_values"]).max() <= TOLERANCE


def test_config_reads_both_size_forms() -> None:
    newer = {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 14}
    older = {"min_pixels": 3136, "max_pixels": 12845056, "merge_size": 2}
    assert Qwen2VLVision.from_preprocessor_config(newer) == Qwen2VLVision(max_pixels=12845056)
    assert Qwen2VLVision.from_preprocessor_config(older) == Qwen2VLVision(max_pixels=12845056)
    both = {"size": {"shortest_edge": 1, "longest_edge": 2}, "min_pixels": 7, "max_pixels": 9}
    config = Qwen2VLVision.from_preprocessor_config(both)
    assert (config.min_pixels, config.max_pixels) == (7, 9)
    assert Qwen2VLVision.from_preprocessor_config({"image_mean": [0.5] * 3}).mean == (0.5,) * 3


def frame_by_frame(frames: list[np.ndarray]) -> np.ndarray:
    """What the video processor gives, built from the image processor: each pair's patch row
    takes time step 0 from the first frame's rows and step 1 from the second's (an odd last
    frame pairs with itself)."""
    if len(frames) % 2:
        frames = [*frames, frames[-1]]
    processor = reference()
    rows = [processor(images=frame, return_tensors="np")["pixel_values"] for frame in frames]
    pairs = []
    for first, second in zip(rows[::2], rows[1::2], strict=True):
        pair = first.reshape(len(first), 3, 2, 14 * 14).copy()
        pair[:, :, 1] = second.reshape(len(second), 3, 2, 14 * 14)[:, :, 1]
        pairs.append(pair.reshape(len(first), -1))
    return np.concatenate(pairs)


@pytest.mark.parametrize("count", [1, 2, 5])
def test_video_at_target_size_matches_frame_by_frame(count: int) -> None:
    rng = np.random.default_rng(count)
    frames = [random_rgb(rng, 112, 84) for _ in range(count)]
    mine = preprocess_video(frames, CONFIG)
    assert mine.grid_thw == ((count + 1) // 2, 8, 6)
    assert mine.tokens == (count + 1) // 2 * 12
    assert np.abs(mine.pixel_values - frame_by_frame(frames)).max() <= TOLERANCE


def test_resized_video_is_within_one_level_of_pillow() -> None:
    rng = np.random.default_rng(3)
    frames = [random_rgb(rng, 240, 320) for _ in range(3)]
    mine = preprocess_video(frames, CONFIG)
    expected = frame_by_frame(frames)
    assert mine.pixel_values.shape == expected.shape
    assert np.abs(mine.pixel_values - expected).max() <= ONE_LEVEL


def test_video_frames_must_share_a_size() -> None:
    with pytest.raises(ValueError, match="share one size"):
        preprocess_video([np.zeros((56, 56, 3), np.uint8), np.zeros((56, 84, 3), np.uint8)], CONFIG)


def test_png_bytes_go_through_end_to_end() -> None:
    pixels = random_rgb(np.random.default_rng(4), 90, 120)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="PNG")
    decoded = decode_image(encoded.getvalue())
    mine = preprocess_image(decoded.pixels, CONFIG)
    expected = reference()(images=Image.open(io.BytesIO(encoded.getvalue())), return_tensors="np")
    assert mine.grid_thw == (1, 6, 8)
    assert np.abs(mine.pixel_values - expected["pixel_values"]).max() <= TOLERANCE
