"""The fast path and speculation on the real default model (SmolLM2-135M, float32): every kind
of decode gives the same tokens with the fast path off, at depth 0, 1 and 4; an inferlet that
changes course mid-generation is served correctly; pages and leases all come back; the kv
actor's inputs replay exactly; the speculator counts what happened. The speculator's pure core,
which adds up the counts, is tested on its own without the model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.actors.kv import KvCore
from pie.actors.speculator import SpeculationStatistics, SpeculatorCore
from pie.config import EngineConfig, with_overrides
from pie.engine import Engine, open_engine
from pie.eventlog.replay import replay
from pie.events.speculation import LanePassApplied, SpeculationTally
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir, real_model  # noqa: F401  (fixture)

SETTINGS = {
    "off": {"fast_path": False},
    "depth 0": {"speculation_depth": 0},
    "depth 1": {"speculation_depth": 1},
    "depth 4": {"speculation_depth": 4},
}
PROMPT = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def real(default_model_dir: Path, pytestconfig: pytest.Config) -> tuple[EngineConfig, Any, Any]:  # noqa: F811
    return real_model(default_model_dir, pytestconfig, num_pages=128)


@pytest.fixture(scope="module")
def probe(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "spec_probe").read_bytes()


async def run_modes(engine: Engine, wasm: bytes, modes: list[str]) -> dict[str, Any]:
    """Runs every mode at once (so they share passes) and returns each one's result."""
    program = engine.programs.add(wasm).hash
    results: dict[str, Any] = {}

    async def one(mode: str) -> None:
        request = json.dumps({"mode": mode, "prompt": PROMPT, "tokens": 12})
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


@pytest.mark.model
async def test_every_decode_gives_the_same_tokens_at_every_depth(
    real: tuple[EngineConfig, Any, Any], probe: bytes
) -> None:
    config, driver, tokenizer = real
    modes = ["greedy", "top_p", "masked", "course"]
    seen: dict[str, dict[str, Any]] = {}
    counts = {}
    for name, scheduler in SETTINGS.items():
        configured = with_overrides(config, scheduler=scheduler)
        async with open_engine(configured, driver=driver, tokenizer=tokenizer) as engine:
            seen[name] = await run_modes(engine, probe, modes)
            with trio.fail_after(10):
                while engine.kv.core.leases:
                    await trio.sleep(0.01)
            counts[name] = engine.statistics().speculation
            assert_everything_returned(engine)
    reference = seen["off"]
    for mode in modes:
        assert len(reference[mode]["generated"]) >= 12
    for name in SETTINGS:
        assert seen[name] == reference, name
    assert counts["off"].leases == 0 and counts["off"].direct == 0
    assert counts["depth 0"].staged == 0 and counts["depth 0"].direct > 20
    for name in ("depth 1", "depth 4"):
        assert counts[name].hits > 20, counts[name]
        # The course changes and the ends of generations are the only misses or waste.
        assert counts[name].hits >= 0.8 * counts[name].staged, counts[name]


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
    hits = [r.event for r in records if isinstance(r.event, LanePassApplied) and r.event.staged]
    assert len(hits) > 10


@pytest.mark.unit
def test_the_speculator_adds_up_the_tallies_of_every_pass() -> None:
    core = SpeculatorCore(depth=4)
    tallies = [
        SpeculationTally(staged=3, hits=2, wasted_passes=1, direct=1, leases=1),
        SpeculationTally(staged=2, hits=2, misses=1, dropped_chains=1, direct=4),
    ]
    assert [core.handle(tally) for tally in tallies] == [[], []]
    statistics = core.statistics()
    assert statistics == SpeculationStatistics(
        depth=4,
        staged=5,
        hits=4,
        misses=1,
        dropped_chains=1,
        wasted_passes=1,
        direct=5,
        leases=1,
    )
    assert statistics.hit_rate == pytest.approx(0.8)


@pytest.mark.unit
def test_the_speculator_refuses_anything_but_a_tally() -> None:
    with pytest.raises(TypeError, match="unexpected event object"):
        SpeculatorCore(depth=1).handle(object())
