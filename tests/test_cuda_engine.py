"""The engine on the CUDA driver (GPU only): the factory picks it where flashinfer and a GPU are
there, and 64 generations decoding together are all served and give back every KV page."""

from __future__ import annotations

import json
from collections.abc import Callable
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
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.test_cuda_driver import GPU_CASES
from tests.test_speculation import with_chat_template
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


async def test_64_inferlets_decoding_on_the_cuda_driver_free_every_page(
    tmp_path: Path,
    built: Callable[[Path], Path],  # noqa: F811
) -> None:
    """64 inferlets (WebAssembly guests) at once on the CUDA driver, in pairs on one prompt: one
    stepping a pass per host call, the other running a generation, with passes chained on the
    device. The pairs make the same tokens, the chains ran, and every page and lease comes
    back."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA driver's GPU tests need one")
    if load_flashinfer()[0] is None:
        pytest.skip(load_flashinfer()[1])
    probe = built(GUESTS / "spec_probe").read_bytes()
    save_tiny_model(tmp_path, GPU_CASES["qwen3"], seed=3)
    with_chat_template(tmp_path)
    config = with_overrides(
        EngineConfig(),
        model={"path": str(tmp_path), "dtype": "bfloat16", "device": "cuda"},
        kv={"num_pages": 1024, "page_size": 16},
        scheduler={"max_batch_requests": 64, "speculation_depth": 2},
    )
    driver, tokenizer = await trio.to_thread.run_sync(build_driver, config)
    made: dict[int, list[int]] = {}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        program = engine.programs.add(probe).hash

        async def one(i: int) -> None:
            mode = "greedy_steps" if i % 2 else "greedy"
            request = json.dumps({"mode": mode, "prompt": f"Story {i // 2}:", "tokens": 24})
            outcome = await engine.run_inferlet(program, request)
            assert outcome.status == "returned", outcome.error
            made[i] = json.loads(outcome.result or "null")["generated"]

        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(one, i)
            while engine.kv.core.leases:
                await trio.sleep(0.01)
        stats = engine.statistics()
    assert sorted(made) == list(range(64))
    assert all(made.values())
    # bfloat16 may part two runs at a near tie when their passes differ in shape.
    same = sum(made[2 * pair] == made[2 * pair + 1] for pair in range(32))
    assert same >= 30, same
    assert stats.speculation.chained > 100, stats.speculation
    assert stats.kv.pages_free == stats.kv.pages_total
    assert stats.kv.leases == 0 and stats.kv.contexts == 0
