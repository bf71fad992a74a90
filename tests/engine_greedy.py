"""Greedy generation through the whole engine next to transformers' `generate`: what every
architecture's engine test checks (each prompt alone, then several contexts batched)."""

from __future__ import annotations

from typing import Any

import torch
import trio
from attrs import frozen

from pie.actors.generate import generate
from pie.config import EngineConfig
from pie.drivers.factory import build_torch_driver
from pie.engine import Engine, EngineStatistics, open_engine
from pie.events.sampling import Argmax


def hf_greedy(model: Any, ids: list[int], n: int, device: str = "cpu") -> list[int]:
    """transformers' n greedy tokens after ids (never stopping early)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return list(out[0, len(ids) :].tolist())


@frozen
class GreedyRun:
    alone: list[list[int]]
    together: list[list[int]]
    """`copies` contexts at once, cycling through the prompts."""
    stats: EngineStatistics


async def greedy_all_at_once(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's n greedy tokens, all prompts generating at once."""
    out: dict[int, list[int]] = {}

    async def run(i: int) -> None:
        async with engine.requester() as req:
            out[i] = list((await generate(req, prompts[i], max_tokens=n, sampler=Argmax())).tokens)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(run, i)
    return [out[i] for i in range(len(prompts))]


async def engine_greedy(
    config: EngineConfig, prompts: list[list[int]], n: int, copies: int = 8
) -> GreedyRun:
    """The engine of `config` on a torch driver: each prompt alone, then `copies` contexts."""
    driver, tokenizer = await trio.to_thread.run_sync(build_torch_driver, config)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        alone = [(await greedy_all_at_once(engine, [ids], n))[0] for ids in prompts]
        batched = [prompts[i % len(prompts)] for i in range(copies)]
        together = await greedy_all_at_once(engine, batched, n)
        return GreedyRun(alone=alone, together=together, stats=engine.statistics())


def assert_matches(run: GreedyRun, expected: list[list[int]]) -> None:
    """Alone and batched equal the reference; the batch really formed; every page came back."""
    assert run.alone == expected
    assert run.together == [expected[i % len(expected)] for i in range(len(run.together))]
    assert run.stats.scheduler.max_batch_size >= len(run.together)
    assert run.stats.kv.pages_free == run.stats.kv.pages_total
