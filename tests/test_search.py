"""Search and branching on the real default model through the example inferlets: beam search of
width 1 is greedy decoding, best-of-n repeats with a seed and its forked branches hold fewer
KV pages than separate prompts, skeleton-of-thought's expansions batch together, and tree- and
graph-of-thought build what they say."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.actors.generate import generate, prompt_ids
from pie.cli.bench.decoding import run_watching_pages
from pie.config import with_overrides
from pie.engine import Engine, open_engine
from pie.events.sampling import Argmax
from tests.inferlet_fixtures import EXAMPLES, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir, real  # noqa: F401  (fixtures)

pytestmark = pytest.mark.model

PROMPT = "Name three animals that live in the sea."


@pytest.fixture(scope="module")
def example(built: Callable[[Path], Path]) -> Callable[[str], bytes]:  # noqa: F811
    return lambda name: built(EXAMPLES / name).read_bytes()


async def run(engine: Engine, wasm: bytes, request: dict[str, Any]) -> Any:
    return await run_json(engine, engine.programs.add(wasm).hash, request)


async def test_beam_search_of_width_one_is_greedy_and_wider_beams_rank_by_score(
    real: Any,  # noqa: F811
    example: Callable[[str], bytes],
) -> None:
    config, driver, tokenizer = real
    wasm = example("beam-search")
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        narrow = await run(engine, wasm, {"prompt": PROMPT, "width": 1, "max_tokens": 20})
        wide = await run(engine, wasm, {"prompt": PROMPT, "width": 3, "max_tokens": 12})
        async with engine.requester() as req:
            stop = list(tokenizer.stop_token_ids)
            greedy = await generate(
                req,
                prompt_ids(tokenizer, PROMPT),
                max_tokens=20,
                sampler=Argmax(),
                stop_tokens=stop,
            )
    (beam,) = narrow["beams"]
    assert beam["tokens"] == [t for t in greedy.tokens if t not in stop]
    beams = wide["beams"]
    assert len(beams) == 3 and len({tuple(b["tokens"]) for b in beams}) == 3
    scores = [b["logprob"] / max(1, len(b["tokens"])) for b in beams]
    assert scores == sorted(scores, reverse=True)
    assert all(b["logprob"] < 0 and math.isfinite(b["logprob"]) for b in beams)


async def peak_pages(engine: Engine, wasm: bytes, request: dict[str, Any]) -> tuple[Any, int]:
    """The inferlet's result and the most KV pages in use while it ran."""
    program = engine.programs.add(wasm).hash
    with trio.fail_after(600):
        outcome, _, pages = await run_watching_pages(engine, program, request)
    assert outcome.ok, outcome.error
    return json.loads(outcome.result), pages


async def test_best_of_n_repeats_with_a_seed_and_forks_share_the_prompts_pages(
    real: Any,  # noqa: F811
    example: Callable[[str], bytes],
) -> None:
    config, driver, tokenizer = real
    config = with_overrides(config, kv={"prefix_cache": "off"})
    wasm = example("best-of-n")
    long_prompt = "Summarise this: " + " ".join(["the tide comes in and goes out"] * 24)
    request = {"prompt": long_prompt, "n": 6, "max_tokens": 8, "seed": 9}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        first, forked_pages = await peak_pages(engine, wasm, request)
        again = await run(engine, wasm, request)
        separate, separate_pages = await peak_pages(engine, wasm, {**request, "separate": True})
    assert [(c["index"], c["text"]) for c in first["candidates"]] == [
        (c["index"], c["text"]) for c in again["candidates"]
    ]
    means = [c["mean_logprob"] for c in first["candidates"]]
    assert means == sorted(means, reverse=True) and all(m < 0 for m in means)
    assert first["best"] == first["candidates"][0]["text"]
    # Same seeds, same branches: only where the prompt's pages live differs.
    assert sorted(c["text"] for c in separate["candidates"]) == sorted(
        c["text"] for c in first["candidates"]
    )
    prompt_pages = len(tokenizer.encode(long_prompt)) // 16
    assert separate_pages - forked_pages >= 4 * prompt_pages
    print(f"peak KV pages: forked {forked_pages}, separate {separate_pages}")


async def test_skeleton_of_thought_expands_its_points_in_one_batch(
    real: Any,  # noqa: F811
    example: Callable[[str], bytes],
) -> None:
    config, driver, tokenizer = real
    request = {"question": "How do I keep a plant healthy?", "points": 3, "point_tokens": 16}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        result = await run(engine, example("skeleton-of-thought"), request)
        stats = engine.statistics()
    assert 2 <= len(result["points"]) <= 3
    assert len(result["expansions"]) == len(result["points"])
    assert all(text.strip() for text in result["expansions"])
    assert stats.scheduler.max_batch_size >= len(result["points"])


async def test_tree_and_graph_of_thought_build_what_they_describe(
    real: Any,  # noqa: F811
    example: Callable[[str], bytes],
) -> None:
    config, driver, tokenizer = real
    tree_request = {
        "problem": "What is 12 times 3?",
        "depth": 2,
        "breadth": 2,
        "keep": 2,
        "seed": 4,
    }
    graph_request = {"task": "Plan a picnic.", "thoughts": 3, "tokens": 16, "seed": 2}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        tree = await run(engine, example("tree-of-thought"), tree_request)
        graph = await run(engine, example("graph-of-thought"), graph_request)
    assert len(tree["steps"]) == 2 and all(step for step in tree["steps"]) and tree["score"] < 0
    kinds = [node["kind"] for node in graph["nodes"]]
    assert kinds == ["thought"] * 3 + ["aggregate", "refine"]
    assert graph["nodes"][3]["from"] == [0, 1, 2] and graph["nodes"][4]["from"] == [3]
    assert graph["answer"] == graph["nodes"][4]["text"]
