"""Attention sinks and a sliding window through the attention-window example: a 4,000-token
generation holds a bounded number of KV pages (the engine's pool shows it, not only the
program), a generation without the window grows with its length, and on the real default model
a windowed reading with attention sinks predicts text almost as well as full attention."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pie.cli.bench.decoding import run_watching_pages
from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import open_engine
from tests.inferlet_fixtures import EXAMPLES, REPO, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import (  # noqa: F401  (fixtures)
    components_dir,
    default_model_dir,
    real,
    tokenizer,
)

EXAMPLE = EXAMPLES / "attention-window"
PROMPT = "The history of the lighthouse keepers of the northern coast begins"


def _bound(result: dict[str, Any]) -> int:
    return int(result["sink_pages"]) + int(result["window_pages"])


@pytest.mark.integration
async def test_a_4000_token_generation_holds_a_bounded_number_of_pages(
    tokenizer: Tokenizer,  # noqa: F811
    built: Callable[[Path], Path],  # noqa: F811
    pytestconfig: pytest.Config,
) -> None:
    config = with_overrides(EngineConfig(), sandbox={"cache_dir": components_dir(pytestconfig)})
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size, num_pages=512)
    wasm = built(EXAMPLE).read_bytes()
    request = {"prompt": PROMPT, "max_tokens": 4000, "window_tokens": 128, "seed": 3}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        program = engine.programs.add(wasm).hash
        outcome, _, peak = await run_watching_pages(engine, program, request)
        assert outcome.ok, outcome.error
        windowed = json.loads(outcome.result)
        plain = await run_json(engine, program, {**request, "max_tokens": 1000, "window": False})
        free_after = engine.statistics().kv.pages_free
    page = windowed["page_size"]
    assert windowed["tokens"] == 4000 and windowed["stop_reason"] == "length"
    assert max(windowed["pages_held"]) <= _bound(windowed) == 1 + 128 // page + 1
    assert peak <= _bound(windowed) + 1  # the pool agrees (one page more while a page turns)
    assert windowed["released_pages"] >= (4000 + len(tokenizer.encode(PROMPT))) // page - 10
    assert max(plain["pages_held"]) >= 1000 // page and plain["released_pages"] == 0
    assert free_after == 512


@pytest.mark.model
async def test_sinks_keep_a_windowed_reading_close_to_full_attention(
    real: Any,  # noqa: F811
    built: Callable[[Path], Path],  # noqa: F811
) -> None:
    """Teacher-forced over a thousand tokens of prose, a page per pass: a window of 128 tokens
    with the first page kept scores the next tokens almost as well as full attention, and the
    same window without sinks scores them clearly worse (the sinks are what keep it text)."""
    config, driver, tokenizer_ = real
    wasm = built(EXAMPLE).read_bytes()
    text = (REPO / "docs" / "architecture.md").read_text()[:4000]
    modes = {
        "full": {"window": False},
        "sinks": {"window_tokens": 128, "sink_tokens": 4},
        "no sinks": {"window_tokens": 128, "sink_tokens": 0},
    }
    scores = {}
    async with open_engine(config, driver=driver, tokenizer=tokenizer_) as engine:
        program = engine.programs.add(wasm).hash
        for mode, extra in modes.items():
            scores[mode] = await run_json(engine, program, {"mode": "score", "text": text, **extra})
    mean = {mode: score["mean_logprob"] for mode, score in scores.items()}
    print(mean)
    assert scores["full"]["tokens"] > 900
    assert scores["sinks"]["max_pages_held"] <= 1 + 128 // 16 + 1
    assert scores["full"]["max_pages_held"] > 60
    assert mean["full"] - mean["sinks"] < 0.35
    assert mean["sinks"] - mean["no sinks"] > 0.4
