"""`pie bench step` on a tiny model: both modes step the same contexts, and each mode's split
names the operations it runs (the compiled kernels in one, torch's attention in the other)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pie.cli.bench.step import measure
from tests.tiny_models import TINY_CASES, save_tiny_model


@pytest.mark.integration
def test_the_step_bench_splits_each_mode_by_the_operations_it_runs(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, TINY_CASES["llama-linear-rope-tied"])
    args = argparse.Namespace(
        batch=2,
        context=20,
        steps=3,
        rounds=2,
        model=str(tmp_path),
        weights="dtype",
        activations="float32",
    )
    figures = measure(args)
    compiled, torch_ops = figures["compiled"]["split_ms"], figures["torch"]["split_ms"]
    assert {"attention kernel", "layer kernels", "float linears"} <= compiled.keys()
    assert "attention (sdpa)" not in compiled
    assert "attention (sdpa)" in torch_ops and "attention kernel" not in torch_ops
    assert "layer kernels" not in torch_ops
    for mode in ("compiled", "torch"):
        assert 0 < figures[mode]["step_ms"]["min"] <= figures[mode]["step_ms"]["max"]
    assert figures["ratio"]["median"] > 0
