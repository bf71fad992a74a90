"""Generation runs in the engine, on the synthetic driver (token t is followed by t + 1): the
same tokens as the stepped loop with the fast path off and at every speculation depth, runs
ended by cancel, truncate, fork or destroy with every page and lease back, a context a run
carries refusing a second run or a pass of its own, and 64 runs at once."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import Engine, open_engine
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

SETTINGS = {
    "off": {"fast_path": False},
    "depth 0": {"speculation_depth": 0},
    "depth 1": {"speculation_depth": 1},
    "depth 4": {"speculation_depth": 4},
}
PROMPT = [100, 101, 102, 103, 104]


@pytest.fixture(scope="module")
def probe(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "run_probe").read_bytes()


def engine_for(tokenizer: Tokenizer, tmp_path: Path, **scheduler: Any) -> Any:
    config = with_overrides(
        EngineConfig(),
        # 128 guests at once: small caps, and a budget that holds them all.
        sandbox={
            "cache_dir": str(tmp_path),
            "max_concurrent": 128,
            "memory_mb": 64,
            "guest_memory_mb": 128 * 64,
        },
        scheduler=scheduler,
        kv={"num_pages": 1024},
    )
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size, pass_seconds=0.001)
    return open_engine(config, driver=driver, tokenizer=tokenizer)


async def run(engine: Engine, program: str, **request: Any) -> Any:
    with trio.fail_after(60):
        outcome = await engine.run_inferlet(program, json.dumps(request))
    assert outcome.ok, outcome.error
    return json.loads(outcome.result or "null")


async def settled(engine: Engine) -> None:
    """Waits for leases of lanes that ended with their programs, then checks nothing is held."""
    with trio.fail_after(10):
        while engine.kv.core.leases or engine.kv.core.in_flight:
            await trio.sleep(0.01)
    kv = engine.statistics().kv
    assert kv.pages_free == kv.pages_total and kv.contexts == 0


@pytest.mark.parametrize("name", list(SETTINGS))
async def test_a_run_gives_the_stepped_loops_tokens(
    probe: bytes, tokenizer: Tokenizer, tmp_path: Path, name: str
) -> None:
    async with engine_for(tokenizer, tmp_path, **SETTINGS[name]) as engine:
        program = engine.programs.add(probe).hash
        for request in (
            {"prompt": PROMPT, "tokens": 40},
            {"prompt": PROMPT, "tokens": 40, "seed": 3},
            {"prompt": PROMPT, "tokens": 40, "stop": [120]},
        ):
            ran = await run(engine, program, mode="whole", **request)
            stepped = await run(engine, program, mode="stepped", **request)
            assert ran == stepped
        await settled(engine)
    assert ran == {"tokens": list(range(105, 120)), "stop": "stop_token"}


@pytest.mark.parametrize("action", ["cancel", "truncate", "fork", "destroy"])
async def test_a_run_ended_midway_leaks_nothing(
    probe: bytes, tokenizer: Tokenizer, tmp_path: Path, action: str
) -> None:
    async with engine_for(tokenizer, tmp_path, speculation_depth=1) as engine:
        program = engine.programs.add(probe).hash
        result = await run(
            engine, program, mode="interrupt", action=action, prompt=PROMPT, tokens=500
        )
        await settled(engine)
        assert engine.statistics().speculation.leases >= 1
    assert result["finished"] == "cancelled"
    tokens = result["tokens"]
    assert 1 <= len(tokens) < 500 and tokens == list(range(105, 105 + len(tokens)))
    assert result["final"] == tokens[-1]
    written = PROMPT + tokens[:-1]  # the last sampled token is never written
    assert result["last_written"] == written[-1]
    if action == "truncate":
        assert result["written"] == written[:-1]
    elif action != "destroy":
        assert result["written"] == written
    if action == "fork":
        assert result["fork"] == written


async def test_a_context_carried_by_a_run_refuses_a_second_run_and_own_passes(
    probe: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    async with engine_for(tokenizer, tmp_path) as engine:
        program = engine.programs.add(probe).hash
        result = await run(engine, program, mode="busy", prompt=PROMPT, tokens=30)
        await settled(engine)
    assert result["refused"] == {"second run": "busy", "forward": "busy"}
    assert result["tokens"] == list(range(105, 135)) and result["finished"] == "length"


async def test_sixty_four_runs_at_once_finish_with_their_own_tokens(
    probe: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    async with engine_for(tokenizer, tmp_path, speculation_depth=1) as engine:
        program = engine.programs.add(probe).hash
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            prompt = [1000 + 100 * i, 1001 + 100 * i]
            results[i] = await run(engine, program, mode="whole", prompt=prompt, tokens=32)

        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(one, i)
        await settled(engine)
        batches = engine.statistics().scheduler
    for i in range(64):
        assert results[i]["tokens"] == list(range(1002 + 100 * i, 1034 + 100 * i)), i
    assert batches.max_batch_size > 16
