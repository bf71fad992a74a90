"""The inferlet host end to end on a hand-written guest (tests/wat_guests/host_calls.wat) and
the synthetic driver: results, errors, traps, budgets, kills, the admission queue, sessions,
and cleanup after every kind of end."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import wasmtime

from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.events import inferlet as ev
from pie.sandbox.host import InstanceState

pytestmark = pytest.mark.integration

GUEST = (Path(__file__).parent / "wat_guests" / "host_calls.wat").read_text()


def config(tmp_path: Path, **sandbox: Any) -> EngineConfig:
    return with_overrides(EngineConfig(), sandbox={"cache_dir": str(tmp_path), **sandbox})


def engine_for(tmp_path: Path, **sandbox: Any) -> Any:
    return open_engine(config(tmp_path, **sandbox), driver=SyntheticDriver())


def add_guest(engine: Engine) -> str:
    return engine.programs.add(bytes(wasmtime.wat2wasm(GUEST)), name="host-calls").hash


def entered_poll(monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """An event set when a guest thread starts waiting in the host for a pollable, a moment the
    engine reports to no one."""
    entered = trio.Event()
    token = trio.lowlevel.current_trio_token()
    wait_any = InstanceState.wait_any

    def waiting(state: InstanceState, handles: list[int]) -> list[int]:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(entered.set)
        return wait_any(state, handles)

    monkeypatch.setattr(InstanceState, "wait_any", waiting)
    return entered


async def test_results_and_errors_reach_the_launcher(tmp_path: Path) -> None:
    async with engine_for(tmp_path) as engine:
        program = add_guest(engine)
        ok = await engine.run_inferlet(program, "o")
        echoed = await engine.run_inferlet(program, "echo this")
        refused = await engine.run_inferlet(program, "x marks the spot")
    assert (ok.status, ok.result) == ("returned", "fine")
    assert echoed.result == "echo this"
    assert (refused.status, refused.error) == ("failed", "x marks the spot")


async def test_a_trap_fails_one_inferlet_and_frees_its_contexts(tmp_path: Path) -> None:
    async with engine_for(tmp_path) as engine:
        program = add_guest(engine)
        trapped = await engine.run_inferlet(program, "c")
        after = await engine.run_inferlet(program, "o")
        # Both guest threads have ended; the kv actor has yet to handle their release.
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().kv.contexts == 0
    assert trapped.status == "trapped" and "unreachable" in (trapped.error or "")
    assert after.ok


async def test_a_looping_guest_stops_at_its_budget_while_another_finishes(tmp_path: Path) -> None:
    outcomes: dict[str, Any] = {}
    async with engine_for(tmp_path, budget_seconds=0.5) as engine:
        program = add_guest(engine)

        async def run(name: str, text: str) -> None:
            outcomes[name] = await engine.run_inferlet(program, text)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "loop", "l")
                nursery.start_soon(run, "ok", "o")
    assert outcomes["loop"].status == "timeout"
    assert 0.4 < outcomes["loop"].seconds < 3
    assert outcomes["ok"].ok


async def test_terminate_wakes_a_guest_blocked_in_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_poll = entered_poll(monkeypatch)
    async with engine_for(tmp_path) as engine, engine.requester() as requester:
        program = add_guest(engine)
        run = await requester.launch(program, "p")
        with trio.fail_after(10):
            await in_poll.wait()
            await run.terminate()
            outcome = await run.outcome()
    assert outcome.status == "terminated" and "terminated by" in (outcome.error or "")


async def test_a_session_message_wakes_the_guest(tmp_path: Path) -> None:
    seen: list[Any] = []
    async with engine_for(tmp_path) as engine, engine.requester() as requester:
        program = add_guest(engine)
        run = await requester.launch(program, "p")
        await run.send(text="wake up")
        with trio.fail_after(5):
            outcome = await run.outcome(seen.append)
    assert outcome.result == "fine"
    assert [type(e) for e in seen] == [ev.InferletStarted]


async def test_launches_beyond_the_limit_queue_instead_of_failing(tmp_path: Path) -> None:
    async with engine_for(tmp_path, max_concurrent=1) as engine, engine.requester() as r:
        program = add_guest(engine)
        runs = [await r.launch(program, "p") for _ in range(3)]
        assert [run.queued for run in runs] == [False, True, True]
        assert engine.statistics().inferlets.queued == 2
        with trio.fail_after(10):
            for run in runs:
                await run.send(text="go")
                assert (await run.outcome()).ok


async def test_shutdown_stops_running_guests(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with engine_for(tmp_path) as engine, engine.requester() as requester:
            program = add_guest(engine)
            await requester.launch(program, "l")
            # The looping guest's thread reports nothing once inside wasm: poll until it is.
            while not engine.wasm.statistics().running:
                await trio.sleep(0.01)
    assert engine.inferlets.core.instances == {}


async def test_bytes_that_are_not_a_component_fail_clearly(tmp_path: Path) -> None:
    async with engine_for(tmp_path) as engine:
        program = engine.programs.add(b"\0asm\x01\x00\x00\x00garbage", name="broken")
        outcome = await engine.run_inferlet(program.hash, "o")
        still_fine = await engine.run_inferlet(add_guest(engine), "o")
    assert outcome.status == "failed" and outcome.error
    assert still_fine.ok


async def test_closing_a_launcher_stops_its_inferlets_ended_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_poll = entered_poll(monkeypatch)
    async with engine_for(tmp_path) as engine:
        program = add_guest(engine)
        async with engine.requester() as requester:
            ended = await requester.launch(program, "o")
            await requester.launch(program, "p")
            with trio.fail_after(10):
                # Read off the channel, not through outcome(): the launcher still tracks it.
                while not isinstance(await ended.events.receive(), ev.InferletEnd):
                    pass
                await in_poll.wait()
        with trio.fail_after(5):
            while engine.inferlets.core.instances:
                await trio.sleep(0.01)
        stats = engine.statistics().inferlets
    assert (stats.returned, stats.terminated) == (1, 1)
    assert "client:" not in " ".join(m.address for m in engine.router.statistics())


async def test_guest_threads_run_at_the_configured_niceness(
    tmp_path: Path, monkeypatch: Any
) -> None:
    import pie.actors.inferlet.actor as actor

    set_to: list[int] = []

    def setpriority(which: int, who: int, niceness: int) -> None:
        assert (which, who) == (os.PRIO_PROCESS, threading.get_native_id())
        set_to.append(niceness)

    monkeypatch.setattr(actor.os, "setpriority", setpriority)
    for niceness in (0, 7):
        async with engine_for(tmp_path, guest_niceness=niceness) as engine:
            outcome = await engine.run_inferlet(add_guest(engine), "o")
        assert outcome.status == "returned"
    assert set_to == [0, 7]
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="guest_niceness"):
            config(tmp_path, guest_niceness=bad)
