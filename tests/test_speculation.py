"""The fast path and speculation on the real default model (SmolLM2-135M, float32): every kind
of decode gives the same tokens with the fast path off, at depth 0, 1 and 4; an inferlet that
changes course mid-generation is served correctly; pages and leases all come back; the kv
actor's inputs replay exactly; the speculator counts what happened (its prediction and staging
are tested without the model in test_speculator.py and test_lanes.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from pie.actors.kv import KvCore
from pie.config import EngineConfig, with_overrides
from pie.drivers.factory import build_driver
from pie.engine import Engine, open_engine
from pie.eventlog.replay import replay
from pie.events.speculation import LanePassesApplied
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir, real_model  # noqa: F401  (fixture)
from tests.tiny_models import save_tiny_model

SETTINGS = {
    "off": {"fast_path": False},
    "depth 0": {"speculation_depth": 0},
    "depth 1": {"speculation_depth": 1},
    "depth 4": {"speculation_depth": 4},
    # Passes launched behind the pass whose tokens they read (on the CPU too, for the test).
    "depth 1 chained": {"speculation_depth": 1, "chain_passes": "on"},
    "depth 4 chained": {"speculation_depth": 4, "chain_passes": "on"},
}
PROMPT = "Write one sentence about the sea."
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""A chat template for the tiny models' tokenizer, which has none."""


@pytest.fixture(scope="module")
def real(default_model_dir: Path, pytestconfig: pytest.Config) -> tuple[EngineConfig, Any, Any]:  # noqa: F811
    return real_model(default_model_dir, pytestconfig, num_pages=128)


@pytest.fixture(scope="module")
def probe(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "spec_probe").read_bytes()


RUN_AND_STEPS = ["greedy", "top_p", "min_p", "top_k", "stop"]
"""Generations run by the engine ("X" or "X_run") and stepped by the program ("X_steps")."""
MODES = [
    *(
        m
        for kind in RUN_AND_STEPS
        for m in (kind if kind != "stop" else "stop_run", f"{kind}_steps")
    ),
    "masked",
    "masked_run",
    "course",
]


def with_chat_template(folder: Path) -> None:
    """Gives the tiny model saved in `folder` a chat template (its tokenizer has none)."""
    settings_file = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(settings_file.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    settings_file.write_text(json.dumps(tokenizer_config))


async def run_modes(
    engine: Engine, wasm: bytes, modes: list[str], stop: str = "", floor: int = 5000
) -> dict[str, Any]:
    """Runs every mode at once (so they share passes) and returns each one's result; the
    masked modes sample ids from `floor` up."""
    program = engine.programs.add(wasm).hash
    results: dict[str, Any] = {}

    async def one(mode: str) -> None:
        request = json.dumps(
            {"mode": mode, "prompt": PROMPT, "tokens": 12, "stop": stop, "floor": floor}
        )
        outcome = await engine.run_inferlet(program, request)
        assert outcome.status == "returned", outcome.error
        results[mode] = json.loads(outcome.result or "null")

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            for mode in modes:
                nursery.start_soon(one, mode)
    return results


def assert_everything_returned(engine: Engine) -> None:
    kv = engine.statistics().kv
    assert kv.pages_free == kv.pages_total
    assert kv.leases == 0 and kv.contexts == 0 and kv.passes_in_flight == 0


def split_stop(tokenizer: Any, tokens: list[int]) -> str:
    """A stop string that starts inside one generated token and ends inside the next."""
    pieces = [tokenizer.decode([t]) for t in tokens]
    text = "".join(pieces)
    for k in range(2, len(pieces) - 1):
        stop = pieces[k][-2:] + pieces[k + 1][:2]
        if (
            len(pieces[k]) >= 2
            and len(pieces[k + 1]) >= 2
            and text.find(stop) == sum(len(p) for p in pieces[:k]) + len(pieces[k]) - 2
        ):
            return stop
    raise AssertionError(f"no stop string splits two tokens of {pieces}")


async def same_tokens_at_every_depth(
    config: EngineConfig,
    driver: Any,
    tokenizer: Any,
    probe: bytes,
    settings: dict[str, Any],
    floor: int = 5000,
) -> dict[str, Any]:
    """Runs every mode under each of `settings` (the first with the fast path off), checks
    they all give the same results, and returns each setting's speculation counts."""
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        greedy = (await run_modes(engine, probe, ["greedy_steps"]))["greedy_steps"]["generated"]
    stop = split_stop(tokenizer, greedy)
    seen: dict[str, dict[str, Any]] = {}
    counts = {}
    for name, scheduler in settings.items():
        configured = with_overrides(config, scheduler=scheduler)
        async with open_engine(configured, driver=driver, tokenizer=tokenizer) as engine:
            seen[name] = await run_modes(engine, probe, MODES, stop, floor)
            with trio.fail_after(10):
                while engine.kv.core.leases:
                    await trio.sleep(0.01)
            counts[name] = engine.statistics().speculation
            assert_everything_returned(engine)
    reference = seen["off"]
    for mode in MODES:
        if not mode.startswith("stop"):
            assert len(reference[mode]["generated"]) >= 12, mode
    for kind in RUN_AND_STEPS:
        ran = reference[kind if kind != "stop" else "stop_run"]
        assert ran == reference[f"{kind}_steps"], kind
    # Raw masked passes leave their last token unwritten; a run queues it, so only the
    # generated tokens compare.
    assert reference["masked_run"]["generated"] == reference["masked"]["generated"]
    stopped = reference["stop_run"]["generated"]
    # The token that completes the stop string ends the generation (its text stops before it).
    assert stopped == greedy[: len(stopped)] and len(stopped) < len(greedy)
    assert stop in tokenizer.decode(stopped) and stop not in tokenizer.decode(stopped[:-1])
    for name in settings:
        assert seen[name] == reference, name
    assert counts["off"].leases == 0 and counts["off"].direct == 0
    assert counts["depth 0"].staged == 0 and counts["depth 0"].direct > 20
    for name in settings:
        if name.startswith(("depth 1", "depth 4")):
            got = counts[name]
            assert got.hits > 20, got
            if got.chained:
                # Chains run up to `depth` passes ahead of their program, so each chain
                # dropped (a course change, the end of a generation) throws that many away.
                assert got.staged - got.hits <= got.depth * got.dropped_chains, got
            else:
                # The course changes and the ends of generations are the only misses or waste.
                assert got.hits >= 0.8 * got.staged, got
    return counts


@pytest.mark.model
async def test_every_decode_gives_the_same_tokens_at_every_depth(
    real: tuple[EngineConfig, Any, Any], probe: bytes
) -> None:
    counts = await same_tokens_at_every_depth(*real, probe, SETTINGS)
    assert counts["depth 1"].chained == 0 and counts["depth 4"].chained == 0
    # Chained passes ran (each one launched before the pass it reads from was collected).
    assert counts["depth 1 chained"].chained > 5, counts["depth 1 chained"]
    assert counts["depth 4 chained"].chained > 20, counts["depth 4 chained"]


@pytest.mark.integration
async def test_every_decode_gives_the_same_tokens_at_every_depth_on_cuda(
    tmp_path: Path, probe: bytes
) -> None:
    """The same on a GPU, float32 on the torch driver (whose passes are launched and chained
    on the device there by default), a tiny random Llama."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU half of the speculation tests needs one")
    # A seed whose greedy text is varied (most random tiny models repeat one token).
    save_tiny_model(tmp_path, dict(model_type="qwen3", head_dim=32), seed=3)
    with_chat_template(tmp_path)
    config = with_overrides(
        EngineConfig(),
        model={"path": str(tmp_path), "dtype": "float32", "device": "cuda"},
        kv={"num_pages": 256, "page_size": 16},
        driver={"backend": "torch"},
    )
    driver, tokenizer = await trio.to_thread.run_sync(build_driver, config)
    settings = {
        "off": {"fast_path": False},
        "depth 0": {"speculation_depth": 0},
        "depth 1": {"speculation_depth": 1},
        "depth 4": {"speculation_depth": 4},
        "depth 4 unchained": {"speculation_depth": 4, "chain_passes": "off"},
    }
    counts = await same_tokens_at_every_depth(config, driver, tokenizer, probe, settings, 100)
    assert counts["depth 1"].chained > 5 and counts["depth 4"].chained > 20, counts
    assert counts["depth 4 unchained"].chained == 0


@pytest.mark.model
async def test_the_kv_actors_inputs_replay_exactly_with_speculation(
    real: tuple[EngineConfig, Any, Any], probe: bytes
) -> None:
    config, driver, tokenizer = real
    configured = with_overrides(config, scheduler={"speculation_depth": 4})
    async with open_engine(configured, driver=driver, tokenizer=tokenizer) as engine:
        await run_modes(engine, probe, ["greedy", "course"])
        with trio.fail_after(10):
            while engine.kv.core.leases:
                await trio.sleep(0.01)
        assert engine.log is not None
        records = engine.log.records()
        info = engine.info
        core = KvCore(
            num_pages=info.num_pages, page_size=info.page_size, vocab_size=info.vocab_size
        )
        result = replay(records, "kv", core)
        live = engine.kv.core.state()
    assert result.exact, result.mismatches
    assert core.state() == live
    applied = [p for r in records if isinstance(r.event, LanePassesApplied) for p in r.event.passes]
    hits = [p for p in applied if p.staged]
    assert len(hits) > 10
