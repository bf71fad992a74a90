"""The whole engine on tiny random models of every architecture, on every device torch sees:
greedy generation equals transformers' on the same device, alone and with 8 contexts batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pie.config import EngineConfig, with_overrides
from tests.engine_greedy import assert_matches, engine_greedy, hf_greedy
from tests.tiny_models import TINY_CASES, save_tiny_model

pytestmark = pytest.mark.integration

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CASES = ["llama-llama3-rope-sharded", "qwen2-qkv-bias", "qwen3-qk-norm-wide-heads"]
PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [250, 11, 64, 64, 9, 30, 31], [8]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
async def test_engine_greedy_equals_transformers(tmp_path: Path, case: str, device: str) -> None:
    reference = save_tiny_model(tmp_path, TINY_CASES[case]).to(device)
    config = with_overrides(
        EngineConfig(),
        model={"path": str(tmp_path), "dtype": "float32", "device": device},
        kv={"num_pages": 256, "page_size": 4},
    )
    expected = [hf_greedy(reference, ids, 20, device) for ids in PROMPTS]
    assert_matches(await engine_greedy(config, PROMPTS, 20), expected)
