"""The engine on the real default model (SmolLM2-135M, float32): generation equals
transformers token for token, forks continue exactly, concurrent contexts batch and agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from pie.actors.generate import generate, prompt_ids
from pie.config import EngineConfig, with_overrides
from pie.drivers.factory import build_torch_driver
from pie.engine import open_engine
from pie.events.sampling import Argmax, Distribution, SamplingSlot, TopP
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in one sentence.",
    "List three primary colours.",
]


@pytest.fixture(scope="module")
def real(default_model_dir: Path) -> tuple[EngineConfig, Any, Any]:  # noqa: F811
    config = with_overrides(
        EngineConfig(),
        model={"path": str(default_model_dir), "dtype": "float32", "device": "cpu"},
        kv={"num_pages": 512},
    )
    driver, tokenizer = build_torch_driver(config)
    return config, driver, tokenizer


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> Any:  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


def _hf_greedy(model: Any, ids: list[int], n: int, eos: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return out[0, len(ids) :].tolist()


async def test_greedy_generation_equals_transformers(real: Any, hf_model: Any) -> None:
    config, driver, tokenizer = real
    ids = prompt_ids(tokenizer, "Tell me a long story about a dragon who learns to bake bread.")
    stop = list(tokenizer.stop_token_ids)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        async with engine.requester() as req:
            ours = await generate(req, ids, max_tokens=48, sampler=Argmax(), stop_tokens=stop)
    assert len(ours.tokens) == 48
    assert list(ours.tokens) == _hf_greedy(hf_model, ids, 48, stop)


async def test_fork_continues_exactly_like_the_unforked_context(real: Any) -> None:
    config, driver, tokenizer = real
    ids = prompt_ids(tokenizer, PROMPTS[1])
    probe = Distribution(k=5)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        async with engine.requester() as req:
            parent = await req.create_context()
            await req.forward(parent, ids[:-3])
            child = await req.fork(parent)
            tail = ids[-3:]
            parent_out = await req.forward(parent, tail, (SamplingSlot(index=2, op=probe),))
            child_out = await req.forward(child, tail, (SamplingSlot(index=2, op=probe),))
            assert parent_out[0].tokens == child_out[0].tokens
            assert parent_out[0].probs == pytest.approx(child_out[0].probs, abs=1e-5)
            # Writing different tokens into the fork leaves the parent untouched.
            await req.forward(child, [tokenizer.encode(" banana")[0]])
            again = await req.fork(parent)
            await req.truncate(again, 3)
            replay = await req.forward(again, tail, (SamplingSlot(index=2, op=probe),))
            assert replay[0].tokens == parent_out[0].tokens
            assert (await req.describe(parent)).tokens == tuple(ids)


async def test_sixteen_concurrent_contexts_batch_and_match_running_alone(real: Any) -> None:
    config, driver, tokenizer = real
    prompts = [prompt_ids(tokenizer, PROMPTS[i % 4] + " " * (i // 4)) for i in range(16)]
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        alone = []
        async with engine.requester() as req:
            for ids in prompts[:4]:
                alone.append((await generate(req, ids, max_tokens=12, sampler=Argmax())).tokens)
        together: dict[int, tuple[int, ...]] = {}
        before = engine.statistics().scheduler

        async def run(i: int) -> None:
            async with engine.requester() as r:
                together[i] = (
                    await generate(r, prompts[i], max_tokens=12, sampler=Argmax())
                ).tokens

        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(run, i)
        stats = engine.statistics()
    for i in range(4):
        assert together[i] == alone[i]
    after = stats.scheduler
    assert after.max_batch_size == 16
    assert (after.requests - before.requests) / (after.batches - before.batches) > 8
    assert stats.kv.pages_free == stats.kv.pages_total


async def test_seeded_sampling_is_reproducible_through_the_engine(real: Any) -> None:
    config, driver, tokenizer = real
    ids = prompt_ids(tokenizer, PROMPTS[3])
    sampler = TopP(temperature=0.9, p=0.9, seed=1234)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        async with engine.requester() as req:
            first = await generate(req, ids, max_tokens=16, sampler=sampler)
            second = await generate(req, ids, max_tokens=16, sampler=sampler)
            other = await generate(
                req, ids, max_tokens=16, sampler=TopP(temperature=0.9, p=0.9, seed=99)
            )
    assert first.tokens == second.tokens
    assert first.tokens != other.tokens
