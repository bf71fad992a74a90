"""The engine on the CUDA driver (GPU only): the factory picks it where flashinfer and a GPU are
there, and 64 generations decoding together are all served and give back every KV page."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from pie.actors.generate import generate
from pie.config import EngineConfig, with_overrides
from pie.drivers.factory import build_driver
from pie.drivers.select import load_flashinfer
from pie.engine import open_engine
from pie.events.sampling import Argmax
from tests.test_cuda_driver import GPU_CASES
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.integration


async def test_64_generations_on_the_cuda_driver_free_every_page(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA driver's GPU tests need one")
    if load_flashinfer()[0] is None:
        pytest.skip(load_flashinfer()[1])
    from pie.drivers.cuda_driver import CudaDriver

    save_tiny_model(tmp_path, GPU_CASES["qwen3"])
    config = with_overrides(
        EngineConfig(),
        model={"path": str(tmp_path), "dtype": "bfloat16", "device": "cuda"},
        kv={"num_pages": 1024, "page_size": 16},
        scheduler={"max_batch_requests": 64},
    )
    driver, tokenizer = await trio.to_thread.run_sync(build_driver, config)
    assert isinstance(driver, CudaDriver)
    made: dict[int, int] = {}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:

        async def one(i: int) -> None:
            async with engine.requester() as req:
                prompt = [(7 * i + j) % 300 + 1 for j in range(5 + i % 7)]
                made[i] = len((await generate(req, prompt, max_tokens=48, sampler=Argmax())).tokens)

        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(one, i)
        stats = engine.statistics()
    assert made == {i: 48 for i in range(64)}
    assert stats.scheduler.max_batch_size >= 32
    assert stats.kv.pages_free == stats.kv.pages_total
