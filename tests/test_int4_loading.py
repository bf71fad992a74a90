"""int4 weights loaded straight from the GGUF file's blocks: the float checkpoint never fills the
layers the file supplies, so their float32 form never becomes resident, and building a model
writes none of its weights before the loader does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pie.drivers.loader import fill_weights, load_model, open_model
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.tiny_models import TINY_CASES, save_tiny_model


@pytest.mark.unit
def test_skipped_parameters_are_neither_read_nor_written(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, TINY_CASES["llama-linear-rope-tied"])
    whole = load_model(str(tmp_path), torch.float32, "cpu").model
    loaded = open_model(str(tmp_path), torch.float32, "cpu")
    skip = {
        ("model.layers.0.self_attn.qkv_proj.weight", "k"),
        ("model.layers.1.mlp.down_proj.weight", None),
    }
    with torch.no_grad():
        for name, _ in skip:
            loaded.model.get_parameter(name).fill_(float("nan"))
    fill_weights(loaded, skip)
    qkv = loaded.model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    shards = loaded.model.get_submodule("model.layers.0.self_attn.qkv_proj").shards
    k_start, k_size = shards["k"]
    assert qkv[k_start : k_start + k_size].isnan().all()
    assert not qkv[:k_start].isnan().any() and not qkv[k_start + k_size :].isnan().any()
    assert loaded.model.get_parameter("model.layers.1.mlp.down_proj.weight").isnan().all()
    for name, param in whole.named_parameters():
        if name not in {n for n, _ in skip}:
            assert torch.equal(loaded.model.get_parameter(name), param), name


_PEAK = """
import json, sys
from pie.config import EngineConfig, with_overrides
from pie.drivers.factory import build_torch_driver
from pie.drivers.memory import peak_resident_mb
model = {"path": sys.argv[1], "weights": sys.argv[2]}
build_torch_driver(with_overrides(EngineConfig(), model=model))
print(json.dumps(peak_resident_mb()))
"""


@pytest.mark.model
def test_building_the_int4_model_never_holds_its_float32_layers(
    default_model_dir: Path,  # noqa: F811
) -> None:
    """The default model's float32 weights take 515 MB, its int4 form 94 MB: an int4 build that
    went through float32 would peak at least as high as a float32 build."""
    peaks = {}
    for weights in ("dtype", "int4"):
        done = subprocess.run(
            [sys.executable, "-c", _PEAK, str(default_model_dir), weights],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        peaks[weights] = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks["int4"] < peaks["dtype"] - 250, peaks
