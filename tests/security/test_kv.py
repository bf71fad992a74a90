"""Attacks on the KV pool and the forward pass by inferlets: a program reserving every page, a
prompt larger than the pool, snapshots that fill it, and passes asking for huge probe outputs.
Each is refused with its own error kind while another user's inferlet is served, and the pool
is whole again afterwards."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.events import inferlet as ev
from pie.events import kv as kv_ev
from tests.inferlet_fixtures import GUESTS, CompiledGuest, compile_guest
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)

pytestmark = pytest.mark.security

PAGES = 64
PAGE = 4


@pytest.fixture(scope="module")
def kv_hog(
    built: Callable[[Path], Path],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> CompiledGuest:
    return compile_guest(built, tmp_path_factory, GUESTS / "kv_hog")


class Pool:
    """An engine with a small KV pool running the kv_hog guest."""

    def __init__(self, engine: Engine, program: str) -> None:
        self.engine = engine
        self.program = program

    async def run(self, user: str = "mallory", **request: Any) -> Any:
        with trio.fail_after(60):
            outcome = await self.engine.run_inferlet(self.program, json.dumps(request), user=user)
        assert outcome.ok, outcome.error
        return json.loads(outcome.result or "null")

    async def served(self) -> None:
        """Another user's generation gives the synthetic driver's tokens (t is followed by t+1)."""
        good = await self.run("alice", mode="good", prompt=[10, 11, 12], tokens=6)
        assert good == {"tokens": [13, 14, 15, 16, 17, 18]}

    async def whole(self) -> None:
        """Every page is free again once the passes and leases of ended inferlets settle."""
        core = self.engine.kv.core
        with trio.fail_after(10):
            while core.leases or core.in_flight or core.contexts:
                await trio.sleep(0.01)
        stats = self.engine.statistics().kv
        assert stats.pages_free == stats.pages_total


@contextlib.asynccontextmanager
async def pool_engine(guest: CompiledGuest, **scheduler: Any) -> AsyncIterator[Pool]:
    config = with_overrides(
        EngineConfig(), sandbox={"cache_dir": str(guest.components)}, scheduler=scheduler
    )
    driver = SyntheticDriver(page_size=PAGE, num_pages=PAGES)
    async with open_engine(config, driver=driver) as engine:
        yield Pool(engine, engine.programs.add(guest.wasm).hash)


async def first_message(events: trio.MemoryReceiveChannel[Any]) -> Any:
    async for event in events:
        if isinstance(event, ev.SessionMessage):
            return json.loads(event.text or "null")
        assert not isinstance(event, ev.InferletEnd), event
    raise AssertionError("the engine stopped")


async def test_a_hog_holding_pages_is_out_of_pages_at_its_quota_while_others_run(
    kv_hog: CompiledGuest,
) -> None:
    async with pool_engine(kv_hog) as pool, pool.engine.requester() as client:
        hog = await client.launch(pool.program, json.dumps({"mode": "hog"}), user="mallory")
        with trio.fail_after(60):
            refused = await first_message(hog.events)
        assert refused == {"refused": "out-of-pages", "contexts": PAGES // 2}
        second = await client.launch(pool.program, json.dumps({"mode": "hog"}), user="mallory")
        with trio.fail_after(60):
            assert await first_message(second.events) == {
                "refused": "out-of-pages",
                "contexts": PAGES * 3 // 4 - PAGES // 2,
            }
        await pool.served()
        for run in (hog, second):
            await run.send(text="done")
            with trio.fail_after(30):
                assert (await run.outcome()).ok
        await pool.whole()


async def test_a_prompt_larger_than_the_pool_is_too_large_and_others_are_served(
    kv_hog: CompiledGuest,
) -> None:
    async with pool_engine(kv_hog) as pool:
        huge = await pool.run(mode="prompt", tokens=PAGES * PAGE + 1)
        assert huge["refused"] == "too-large"
        over_quota = await pool.run(mode="prompt", tokens=PAGES * PAGE // 2 + 1)
        assert over_quota["refused"] == "too-large" and "at most 32" in over_quota["message"]
        assert await pool.run(mode="prompt", tokens=PAGES * PAGE // 2) == {"tokens": 128}
        await pool.served()
        await pool.whole()


async def test_one_users_snapshots_stop_at_their_quota_and_the_operator_can_drop_them(
    kv_hog: CompiledGuest,
) -> None:
    async with pool_engine(kv_hog) as pool, pool.engine.requester() as operator:
        filled = await pool.run(mode="save", tokens=4 * PAGE)
        assert filled["refused"] == "snapshot-quota" and filled["saved"] == PAGES // 4 // 4
        assert (await pool.run("alice", mode="save", tokens=4 * PAGE))["saved"] == 4
        await pool.served()
        await operator.call("kv", kv_ev.DropSnapshots, user="mallory")
        assert {user for user, _ in pool.engine.kv.core.snapshots} == {"alice"}
        assert (await pool.run(mode="save", tokens=4 * PAGE))["saved"] == 4
        await operator.call("kv", kv_ev.DropSnapshots, user="mallory")
        await operator.call("kv", kv_ev.DropSnapshots, user="alice")
        await pool.whole()


async def test_a_pass_asking_for_too_many_probes_is_invalid_before_the_driver_runs_it(
    kv_hog: CompiledGuest,
) -> None:
    async with pool_engine(kv_hog, max_slots_per_pass=32, max_probe_values=5000) as pool:
        passes = pool.engine.statistics().inference.passes
        slots = await pool.run(mode="probe", probe="entropy", slots=33)
        assert slots["refused"] == "invalid" and "max_slots_per_pass" in slots["message"]
        logits = await pool.run(mode="probe", probe="logits", slots=6)
        assert logits["refused"] == "invalid" and "max_probe_values" in logits["message"]
        wide = await pool.run(mode="probe", probe="distribution", k=1000, slots=3)
        assert wide["refused"] == "invalid"
        assert pool.engine.statistics().inference.passes == passes
        assert await pool.run("alice", mode="probe", probe="entropy", slots=32) == {"outputs": 32}
        assert await pool.run("alice", mode="probe", probe="logits", slots=5) == {"outputs": 5}
        await pool.served()
        await pool.whole()
