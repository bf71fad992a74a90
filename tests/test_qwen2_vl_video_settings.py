"""A Qwen2-VL checkpoint's video_preprocessor_config.json: the loader reads it beside
preprocessor_config.json, and video (not images) takes its pixel bounds, giving the grid
transformers gives from the file its video processor reads; without one, video takes the image
processor's settings, and one that disagrees with the tower's temporal patch is refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.video_processing_utils import BaseVideoProcessor

from pie.drivers.loader import load_model
from tests.test_models_qwen2_vl import FAMILIES, PROCESSOR
from tests.tiny_models import VOCAB, write_tiny_tokenizer

pytestmark = pytest.mark.unit

VIDEO = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 12}
HEIGHT, WIDTH, FRAMES = 112, 168, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen2-vl-video")
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(FAMILIES["qwen2_vl"][1]).save_pretrained(root)
    (root / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    write_tiny_tokenizer(root, VOCAB)
    return root


def video() -> SimpleNamespace:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (FRAMES, HEIGHT, WIDTH, 3), dtype=np.uint8)
    return SimpleNamespace(frames=[SimpleNamespace(pixels=f) for f in frames])


def grids(folder: Path, video_settings: dict[str, Any] | None) -> tuple[Any, Any]:
    """(video grid, image grid of one frame) of the model loaded with `video_settings` as its
    video_preprocessor_config.json (None: without one)."""
    path = folder / "video_preprocessor_config.json"
    path.unlink(missing_ok=True)
    if video_settings is not None:
        path.write_text(json.dumps(video_settings))
    model: Any = load_model(str(folder), torch.float32, "cpu").model
    clip = video()
    return model.patches("video", clip).grid_thw, model.patches("image", clip.frames[0]).grid_thw


def transformers_grid(folder: Path) -> tuple[int, int, int]:
    """The grid transformers' Qwen2-VL video processor gives, from the settings it reads."""
    settings, _ = BaseVideoProcessor.get_video_processor_dict(str(folder))
    bounds = {"min_pixels": settings["min_pixels"], "max_pixels": settings["max_pixels"]}
    height, width = smart_resize(HEIGHT, WIDTH, factor=28, **bounds)
    return FRAMES // 2, height // 14, width // 14


def test_video_takes_the_video_processor_settings_and_images_do_not(folder: Path) -> None:
    without_video, image = grids(folder, None)
    assert without_video == (FRAMES // 2, *image[1:]) == transformers_grid(folder)
    with_video, image_after = grids(folder, VIDEO)
    # 112 x 168 shrinks to 56 x 112 under 12 merged patches' worth of pixels.
    assert with_video == transformers_grid(folder) == (2, 4, 8)
    assert with_video != without_video and image_after == image


def test_a_video_settings_file_against_the_towers_temporal_patch_is_refused(folder: Path) -> None:
    with pytest.raises(ValueError, match="video_preprocessor_config.json disagrees"):
        grids(folder, {**VIDEO, "temporal_patch_size": 1})
