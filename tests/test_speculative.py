"""Speculative decoding as a program (the speculative-decoding example) on the real default
model: prompt lookup and Jacobi drafts give plain generation's tokens, greedy and seeded, leave
the context holding the same tokens, and take fewer passes on text that repeats its prompt."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.engine import open_engine
from tests.inferlet_fixtures import EXAMPLES
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir, real  # noqa: F401  (fixtures)

pytestmark = pytest.mark.model

REPEAT = (
    "Copy the following list exactly: apple, banana, cherry, date, elderberry, fig, grape, "
    "honeydew, kiwi, lemon, mango, nectarine."
)


@pytest.fixture(scope="module")
def wasm(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(EXAMPLES / "speculative-decoding").read_bytes()


async def results(real: Any, wasm: bytes, requests: list[dict[str, Any]]) -> list[Any]:  # noqa: F811
    config, driver, tokenizer = real
    out = []
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        program = engine.programs.add(wasm).hash
        for request in requests:
            with trio.fail_after(600):
                outcome = await engine.run_inferlet(program, json.dumps(request))
            assert outcome.ok, outcome.error
            out.append(json.loads(outcome.result))
    return out


async def test_drafts_give_plain_greedy_tokens_in_fewer_passes(real: Any, wasm: bytes) -> None:  # noqa: F811
    base = {"prompt": REPEAT, "max_tokens": 64}
    plain, lookup, jacobi = await results(
        real, wasm, [{**base, "method": m} for m in ("plain", "lookup", "jacobi")]
    )
    assert len(plain["tokens"]) > 16
    for speculative in (lookup, jacobi):
        assert speculative["tokens"] == plain["tokens"]
        assert speculative["stop_reason"] == plain["stop_reason"]
        assert speculative["written"] == plain["written"]
        assert speculative["accepted"] <= speculative["drafted"]
    # The answer quotes the prompt and then repeats itself: many drafts are right, and the
    # passes drop well below one per token (measured: 41 passes for 64 tokens).
    assert lookup["accepted"] > 0.25 * lookup["drafted"]
    assert lookup["passes"] < 0.8 * plain["passes"]
    assert jacobi["passes"] <= plain["passes"]
    print(
        f"lookup: {lookup['passes']} passes for {plain['passes']},"
        f" acceptance {lookup['accepted'] / lookup['drafted']:.2f};"
        f" jacobi: {jacobi['passes']} passes"
    )


async def test_seeded_sampling_and_the_length_limit_match_plain_generation(
    real: Any,  # noqa: F811
    wasm: bytes,
) -> None:
    base = {"prompt": REPEAT, "temperature": 0.7, "seed": 21, "draft_tokens": 6}
    requests = [
        {**base, "method": method, "max_tokens": tokens}
        for tokens in (40, 7)
        for method in ("plain", "lookup")
    ]
    plain, lookup, short_plain, short_lookup = await results(real, wasm, requests)
    assert lookup["tokens"] == plain["tokens"] and lookup["written"] == plain["written"]
    assert short_lookup["tokens"] == short_plain["tokens"]
    assert short_lookup["stop_reason"] == short_plain["stop_reason"] == "length"
    assert short_lookup["written"] == short_plain["written"]
