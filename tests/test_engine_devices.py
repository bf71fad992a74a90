"""The whole engine on tiny random models of every architecture, on every device torch sees:
greedy generation equals transformers' on the same device, alone and with 8 contexts batched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from pie.actors.generate import generate
from pie.config import EngineConfig, with_overrides
from pie.drivers.factory import build_torch_driver
from pie.engine import open_engine
from pie.events.sampling import Argmax
from tests.tiny_models import TINY_CASES, save_tiny_model

pytestmark = pytest.mark.integration

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CASES = ["llama-llama3-rope-sharded", "qwen2-qkv-bias", "qwen3-qk-norm-wide-heads"]
PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [250, 11, 64, 64, 9, 30, 31], [8]]


def _hf_greedy(model: Any, ids: list[int], n: int, device: str) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
async def test_engine_greedy_equals_transformers(tmp_path: Path, case: str, device: str) -> None:
    reference = save_tiny_model(tmp_path, TINY_CASES[case]).to(device)
    config = with_overrides(
        EngineConfig(),
        model={"path": str(tmp_path), "dtype": "float32", "device": device},
        kv={"num_pages": 256, "page_size": 4},
    )
    driver, tokenizer = await trio.to_thread.run_sync(build_torch_driver, config)
    expected = [_hf_greedy(reference, ids, 20, device) for ids in PROMPTS]
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        async with engine.requester() as req:
            alone = [
                (await generate(req, ids, max_tokens=20, sampler=Argmax())).tokens
                for ids in PROMPTS
            ]
        together: dict[int, tuple[int, ...]] = {}

        async def run(i: int) -> None:
            async with engine.requester() as r:
                ids = PROMPTS[i % len(PROMPTS)]
                together[i] = (await generate(r, ids, max_tokens=20, sampler=Argmax())).tokens

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(run, i)
        stats = engine.statistics()
    assert [list(t) for t in alone] == expected
    assert [list(together[i]) for i in range(8)] == [expected[i % len(PROMPTS)] for i in range(8)]
    assert stats.scheduler.max_batch_size >= 8
    assert stats.kv.pages_free == stats.kv.pages_total
