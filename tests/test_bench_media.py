"""`pie bench media` at its smallest: every figure is there and sane, each picture's soft tokens are
transformers' count for its size, and eight image requests at once share passes."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from transformers import Qwen2VLImageProcessorPil

from pie.cli.bench.media import STAGES, measure
from pie.cli.bench.media_models import VL_PROCESSOR

pytestmark = pytest.mark.integration

SIZES = [(112, 84), (224, 168)]


def processor_tokens(width: int, height: int) -> int:
    """Soft tokens transformers' Qwen2-VL image processor gives a picture of this size."""
    processor = Qwen2VLImageProcessorPil(**VL_PROCESSOR, patch_size=14)
    pixels = np.zeros((height, width, 3), np.uint8)
    grid = processor(images=[pixels], return_tensors="pt")["image_grid_thw"]
    return int(grid.prod()) // 4


def test_the_media_bench_reports_every_stage_and_concurrent_requests_share_passes(
    tmp_path: Path,
) -> None:
    args = argparse.Namespace(
        repeats=1,
        image_sizes=SIZES,
        audio_seconds=2.0,
        requests=8,
        tokens=4,
        hidden=64,
        layers=1,
        vision_dim=64,
        vision_depth=1,
        patch=14,
        cache_dir=str(tmp_path),
    )
    figures = measure(args)
    for width, height in SIZES:
        row = figures[f"image_{width}x{height}"]
        assert row["soft_tokens"] == processor_tokens(width, height)
        for stage in STAGES:
            assert 0 < row[stage]["min"] <= row[stage]["median"] <= row[stage]["max"]
    assert figures["video"]["grid"][0] == 4  # eight frames, two to a temporal patch
    assert figures["audio"]["soft_tokens"] == 50  # two seconds, 25 soft tokens a second
    assert figures["audio"]["decode_preprocess_ms_per_second"]["median"] > 0
    engine = figures["engine"]
    assert engine["concurrent_mean_batch_size"]["median"] > 1
    assert engine["sequential_mean_batch_size"]["median"] == 1
    # Each round's pictures are new (none found in the encoder cache): one at a time, each takes
    # an encoder call of its own; at once, those appended in one pass share one.
    assert engine["sequential_encoder_calls"]["median"] == 8
    assert 1 <= engine["concurrent_encoder_calls"]["median"] <= 8
    for order in ("concurrent", "sequential"):
        assert engine[f"{order}_wall_s"]["median"] > 0
        assert engine[f"{order}_tokens_per_second"]["median"] > 0
    assert engine["speedup"]["median"] > 0
