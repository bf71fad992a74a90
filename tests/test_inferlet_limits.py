"""Python inferlets under load and out of line on the real default model: eight launched at
once share batches and all get the right answer; a looping guest is stopped at its budget, a
raising one fails, and a hoarding one hits its memory cap, while others carry on."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio

from pie.engine import open_engine
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.test_examples import Real, example  # noqa: F401  (fixture)

pytestmark = pytest.mark.model

COMPLETION = {"prompt": "Name three colours.", "max_tokens": 12, "temperature": 0}


def with_sandbox(config: Any, **sandbox: Any) -> Any:
    return attrs.evolve(config, sandbox=attrs.evolve(config.sandbox, **sandbox))


async def launch_all(engine: Any, runs: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    outcomes: list[Any] = [None] * len(runs)

    async def one(i: int, program: str, request: dict[str, Any]) -> None:
        outcomes[i] = await engine.run_inferlet(program, json.dumps(request))

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            for i, (program, request) in enumerate(runs):
                nursery.start_soon(one, i, program, request)
    return outcomes


async def test_eight_inferlets_at_once_share_batches_and_agree(
    real: Real,  # noqa: F811
    example: Callable[[str], bytes],  # noqa: F811
) -> None:
    config, driver, tokenizer = real
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        program = engine.programs.add(example("text-completion")).hash
        alone = (await launch_all(engine, [(program, COMPLETION)]))[0]
        before = engine.statistics().scheduler
        together = await launch_all(engine, [(program, COMPLETION)] * 8)
        after = engine.statistics().scheduler
    assert alone.ok and alone.result
    assert [o.result for o in together] == [alone.result] * 8
    decode_passes = after.batches - before.batches
    # All eight share passes (8 here when the machine is quiet; a busy CI machine can split one).
    assert after.max_batch_size >= 6
    # 8 x (1 prefill + 11 decodes) requests ran in far fewer passes than one each.
    assert decode_passes < 8 * 12 / 2


async def misbehave_beside_a_completion(
    real: Real,  # noqa: F811
    example: Callable[[str], bytes],  # noqa: F811
    mode: str,
    **sandbox: Any,
) -> tuple[Any, Any]:
    """The misbehaving guest in `mode` and a text completion, launched together."""
    config, driver, tokenizer = real
    config = with_sandbox(config, **sandbox)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        misbehaving = engine.programs.add(example("misbehave")).hash
        completing = engine.programs.add(example("text-completion")).hash
        bad, good = await launch_all(
            engine, [(misbehaving, {"mode": mode}), (completing, COMPLETION)]
        )
    return bad, good


async def test_a_looping_guest_is_stopped_at_its_budget_while_another_completes(
    real: Real,  # noqa: F811
    example: Callable[[str], bytes],  # noqa: F811
) -> None:
    loop, done = await misbehave_beside_a_completion(real, example, "loop", budget_seconds=3.0)
    assert loop.status == "timeout" and "budget" in loop.error
    assert 2.5 < loop.seconds < 6
    assert done.ok and done.result


async def test_a_raising_guest_fails_with_its_error(
    real: Real,  # noqa: F811
    example: Callable[[str], bytes],  # noqa: F811
) -> None:
    config, driver, tokenizer = real
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        program = engine.programs.add(example("misbehave")).hash
        outcome = await engine.run_inferlet(program, json.dumps({"mode": "raise"}))
    assert outcome.status == "failed"
    assert "ValueError: boom" in outcome.error


async def test_a_guest_over_its_memory_cap_is_stopped_and_others_carry_on(
    real: Real,  # noqa: F811
    example: Callable[[str], bytes],  # noqa: F811
) -> None:
    hoard, done = await misbehave_beside_a_completion(real, example, "alloc", memory_mb=64)
    # CPython inside the guest turns the refused memory.grow into a MemoryError.
    assert hoard.status in ("failed", "memory", "trapped")
    assert "MemoryError" in hoard.error or "memory" in hoard.error.lower()
    assert done.ok and done.result
