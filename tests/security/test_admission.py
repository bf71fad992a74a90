"""Attacks on admission and on the bus's waiting pulls: a user who launches many long-running
inferlets, or who keeps pull after pull waiting, holds what it already has, and another user is
admitted at the next free slot (or pulls) and served correctly."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import wasmtime

from pie.actors.requester import InferletRun, RequestRefused
from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.events import bus as bus_ev

pytestmark = pytest.mark.security

GUEST = (Path(__file__).parent.parent / "wat_guests" / "host_calls.wat").read_text()
WAITS, RETURNS = "p", "o"
"""The guest's inputs: wait for a session message and return "fine", or return it at once."""


@contextlib.asynccontextmanager
async def engine_with_guest(tmp_path: Path, **config: Any) -> AsyncIterator[tuple[Engine, str]]:
    sandbox = {"cache_dir": str(tmp_path), **config.pop("sandbox", {})}
    settings = with_overrides(EngineConfig(), sandbox=sandbox, **config)
    async with open_engine(settings, driver=SyntheticDriver()) as engine:
        yield engine, engine.programs.add(bytes(wasmtime.wat2wasm(GUEST)), name="host-calls").hash


async def settled(engine: Engine) -> None:
    """Nothing is left running or queued."""
    while engine.statistics().inferlets.running + engine.statistics().inferlets.queued:
        await trio.sleep(0.01)


async def end(runs: list[InferletRun]) -> None:
    for run in runs:
        await run.terminate()
        await run.outcome()


async def test_another_users_launch_takes_the_next_free_slot_ahead_of_a_hogs_queue(
    tmp_path: Path,
) -> None:
    async with (
        engine_with_guest(tmp_path, sandbox={"max_concurrent": 2}) as (engine, program),
        engine.requester() as mallory,
        engine.requester() as alice,
    ):
        with trio.fail_after(60):
            hogs = [await mallory.launch(program, WAITS, user="mallory") for _ in range(8)]
            good = await alice.launch(program, RETURNS, user="alice")
            assert good.queued and engine.statistics().inferlets.queued == 7
            await end(hogs[:1])
            # First in line were mallory's six queued inferlets: alice's went ahead of them.
            outcome = await good.outcome()
            queued_after = engine.statistics().inferlets.queued
            await end(hogs[1:])
            await settled(engine)
    assert [run.queued for run in hogs] == [False, False] + [True] * 6
    assert outcome.ok and outcome.result == "fine"
    assert queued_after == 5


async def test_a_users_running_bound_leaves_slots_for_others(tmp_path: Path) -> None:
    limits = {"max_concurrent": 4, "max_running_per_user": 2}
    async with (
        engine_with_guest(tmp_path, sandbox=limits) as (engine, program),
        engine.requester() as mallory,
        engine.requester() as alice,
    ):
        with trio.fail_after(60):
            hogs = [await mallory.launch(program, WAITS, user="mallory") for _ in range(6)]
            held = engine.statistics().inferlets
            good = await alice.launch(program, RETURNS, user="alice")
            outcome = await good.outcome()
            await end(hogs)
            await settled(engine)
    assert (held.running, held.queued) == (2, 4)
    assert not good.queued and outcome.ok and outcome.result == "fine"


async def test_a_requester_over_its_waiting_pulls_gets_overrun_while_another_pulls(
    tmp_path: Path,
) -> None:
    async with (
        engine_with_guest(tmp_path, bus={"max_waiting_pulls": 16}) as (engine, _),
        engine.requester() as alice,
    ):
        with trio.fail_after(30):
            async with engine.requester() as mallory, trio.open_nursery() as nursery:
                for n in range(16):
                    nursery.start_soon(mallory.pull, f"hoard{n}")
                while engine.statistics().bus.waiting_pulls < 16:
                    await trio.sleep(0.01)
                with pytest.raises(RequestRefused) as refusal:
                    await mallory.call("bus", bus_ev.Pull, queue="one-more")
                await alice.push("alice-jobs", "wash")
                pulled = await alice.pull("alice-jobs")
                nursery.cancel_scope.cancel()
            left = engine.statistics().bus.waiting_pulls
    assert refusal.value.kind == "overrun" and "max_waiting_pulls" in refusal.value.message
    assert pulled == "wash"
    assert left == 0
