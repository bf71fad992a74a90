"""Attacks by inferlets on what all inferlets share: instances (fork bombs, deep chains, one
user's flood of launches), guest memory and /scratch. Each is refused or stopped with its own
clear error while another user's inferlet is served."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.actors.requester import RequestRefused
from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.events.inferlet import InferletOutcome
from tests.inferlet_fixtures import GUESTS, CompiledGuest, compile_guest
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)

pytestmark = pytest.mark.security

MIB = 1 << 20


@pytest.fixture(scope="module")
def hostile(
    built: Callable[[Path], Path],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> CompiledGuest:
    return compile_guest(built, tmp_path_factory, GUESTS / "hostile")


class Hostile:
    """An engine running the hostile guest."""

    def __init__(self, engine: Engine, program: str) -> None:
        self.engine = engine
        self.program = program

    async def run(self, user: str = "mallory", **request: Any) -> InferletOutcome:
        with trio.fail_after(60):
            return await self.engine.run_inferlet(self.program, json.dumps(request), user=user)

    async def served(self) -> None:
        """Another user's inferlet runs and returns."""
        good = await self.run("alice", mode="ok")
        assert good.ok and good.result == "fine"

    async def settled(self) -> None:
        """Nothing is left running or queued."""
        with trio.fail_after(30):
            while (
                self.engine.statistics().inferlets.running
                + self.engine.statistics().inferlets.queued
            ):
                await trio.sleep(0.01)


@contextlib.asynccontextmanager
async def hostile_engine(guest: CompiledGuest, **sandbox: Any) -> AsyncIterator[Hostile]:
    config = with_overrides(EngineConfig(), sandbox={"cache_dir": str(guest.components), **sandbox})
    async with open_engine(config, driver=SyntheticDriver()) as engine:
        yield Hostile(engine, engine.programs.add(guest.wasm).hash)


def result(outcome: InferletOutcome) -> Any:
    assert outcome.ok, outcome.error
    return json.loads(outcome.result or "null")


async def test_a_fork_bomb_is_refused_at_the_children_limit(hostile: CompiledGuest) -> None:
    async with hostile_engine(hostile, max_children=5) as attack:
        bomb = result(await attack.run(mode="bomb", program=attack.program))
        refused = attack.engine.statistics().inferlets.refused
        await attack.served()
        await attack.settled()
    assert bomb["launched"] == 5 and bomb["kind"] == "too-many-inferlets"
    assert "sandbox.max_children" in bomb["message"]
    assert refused == 1


async def test_a_fork_bomb_stops_at_its_users_limit(hostile: CompiledGuest) -> None:
    async with hostile_engine(hostile, max_inferlets_per_user=4, max_concurrent=2) as attack:
        bomb = result(await attack.run(mode="bomb", program=attack.program))
        await attack.served()
    # The bomb itself is one of its user's four.
    assert bomb["launched"] == 3 and bomb["kind"] == "too-many-inferlets"
    assert "sandbox.max_inferlets_per_user" in bomb["message"]


async def test_a_chain_of_children_stops_at_the_depth_limit(hostile: CompiledGuest) -> None:
    async with hostile_engine(hostile, max_child_depth=3) as attack:
        chain = result(await attack.run(mode="deep", program=attack.program))
        await attack.served()
    assert chain["depth"] == 3 and chain["kind"] == "too-many-inferlets"
    assert "sandbox.max_child_depth" in chain["message"]


async def test_a_users_flood_of_launches_is_refused_and_other_users_run(
    hostile: CompiledGuest,
) -> None:
    async with (
        hostile_engine(hostile, max_inferlets_per_user=3) as attack,
        attack.engine.requester() as client,
    ):
        with trio.fail_after(60):
            flood = [
                await client.launch(attack.program, json.dumps({"mode": "wait"}), user="mallory")
                for _ in range(3)
            ]
            with pytest.raises(RequestRefused) as refusal:
                await client.launch(attack.program, json.dumps({"mode": "ok"}), user="mallory")
            await attack.served()
            for run in flood:
                await run.terminate()
            await attack.settled()
    assert refusal.value.kind == "too_many_inferlets"
    assert "user 'mallory' already has 3" in refusal.value.message


async def test_guests_are_admitted_only_while_the_memory_budget_has_room(
    hostile: CompiledGuest,
) -> None:
    async with (
        hostile_engine(hostile, memory_mb=48, guest_memory_mb=96) as attack,
        attack.engine.requester() as client,
    ):
        with trio.fail_after(60):
            hogs = [
                await client.launch(attack.program, json.dumps({"mode": "wait"}), user="mallory")
                for _ in range(3)
            ]
            stats = attack.engine.statistics().inferlets
            # Ending two hogs makes room for the queued one and for another user's inferlet.
            for run in hogs[:2]:
                await run.terminate()
            await attack.served()
            await hogs[2].terminate()
            await attack.settled()
    assert [run.queued for run in hogs] == [False, False, True]
    assert stats.running == 2 and stats.queued == 1


async def test_a_guest_over_its_memory_cap_ends_memory(hostile: CompiledGuest) -> None:
    async with hostile_engine(hostile, memory_mb=48) as attack:
        hoard = await attack.run(mode="alloc")
        await attack.served()
    assert hoard.status == "memory", hoard
    assert (hoard.error or "").startswith("the program ran out of memory (cap 48 MiB)")


async def test_writing_into_an_unlinked_file_counts_against_the_scratch_quota(
    hostile: CompiledGuest, tmp_path: Path
) -> None:
    root = tmp_path / "scratch"
    async with (
        hostile_engine(
            hostile, scratch_dir=str(root), scratch_quota_mb=1, files_check_ms=10
        ) as attack,
        attack.engine.requester() as client,
    ):
        with trio.fail_after(60):
            run = await client.launch(
                attack.program, json.dumps({"mode": "unlink", "size": 8 * MIB}), user="mallory"
            )
            hidden = await run.outcome()
            await attack.served()
    assert hidden.status == "quota", hidden
    assert (hidden.error or "").startswith("/scratch holds more than its quota of 1 MiB")
    assert list(root.iterdir()) == []
