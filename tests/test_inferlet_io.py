"""Python inferlets talking: child inferlets and queues, topics between two inferlets, session
messages both ways, and children that end with their parent. On the synthetic driver, with the
default model's tokenizer (no forward pass is needed here)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import Engine, open_engine
from pie.events import inferlet as ev
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def social(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "social").read_bytes()


def engine_for(tokenizer: Tokenizer, tmp_path: Path) -> Any:
    config = with_overrides(EngineConfig(), sandbox={"cache_dir": str(tmp_path)})
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size)
    return open_engine(config, driver=driver, tokenizer=tokenizer)


def add(engine: Engine, wasm: bytes) -> str:
    return engine.programs.add(wasm, name="social").hash


async def test_children_push_to_a_queue_their_parent_pulls(
    social: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    async with engine_for(tokenizer, tmp_path) as engine:
        program = add(engine, social)
        with trio.fail_after(60):
            outcome = await engine.run_inferlet(program, json.dumps({"mode": "parent"}))
        assert engine.statistics().inferlets.returned == 4
    assert outcome.ok, outcome.error
    assert json.loads(outcome.result or "") == {
        "results": ["child 0 done", "child 1 done", "child 2 done"],
        "pulled": ["hello from 0", "hello from 1", "hello from 2"],
    }


async def test_a_subscriber_gets_what_another_inferlet_broadcasts(
    social: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    async with engine_for(tokenizer, tmp_path) as engine, engine.requester() as requester:
        program = add(engine, social)
        with trio.fail_after(60):
            subscriber = await requester.launch(program, json.dumps({"mode": "subscriber"}))
            async for event in subscriber.events:
                if isinstance(event, ev.SessionMessage):
                    break
            request = json.dumps({"mode": "publisher", "items": ["first", "second"]})
            published = await engine.run_inferlet(program, request)
            received = await subscriber.outcome()
    assert published.result == "published"
    assert json.loads(received.result or "") == ["first", "second"]


async def test_session_messages_go_both_ways(
    social: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    sent: list[Any] = []
    async with engine_for(tokenizer, tmp_path) as engine, engine.requester() as requester:
        run = await requester.launch(add(engine, social), json.dumps({"mode": "echo"}))
        await run.send(data=b"\x01\x02")
        with trio.fail_after(60):
            outcome = await run.outcome(sent.append)
    assert [e.data for e in sent if isinstance(e, ev.SessionMessage)] == [b"\x00binary"]
    assert json.loads(outcome.result or "") == {"got": "0102"}


async def test_children_end_with_their_parent(
    social: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    async with engine_for(tokenizer, tmp_path) as engine:
        program = add(engine, social)
        with trio.fail_after(60):
            outcome = await engine.run_inferlet(program, json.dumps({"mode": "orphan-maker"}))
            while engine.statistics().inferlets.running:
                await trio.sleep(0.01)
        stats = engine.statistics().inferlets
    assert outcome.status == "failed" and "leaving my child behind" in (outcome.error or "")
    assert stats.terminated == 1 and stats.queued == 0


async def test_a_fan_out_of_children_returns_every_result(
    social: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    async with engine_for(tokenizer, tmp_path) as engine:
        program = add(engine, social)
        with trio.fail_after(120):
            outcome = await engine.run_inferlet(program, json.dumps({"mode": "fan-out", "n": 12}))
        stats = engine.statistics().inferlets
    assert outcome.ok, outcome.error
    result = json.loads(outcome.result or "")
    assert result["squares"] == [k * k for k in range(12)]
    failed, terminated = result["errors"]
    assert "failed" in failed and "no square for -1" in failed
    assert "terminated" in terminated
    assert (stats.returned, stats.failed, stats.terminated) == (13, 1, 1)
    assert stats.running == 0


async def test_a_detached_child_outlives_its_parent_and_an_attached_one_does_not(
    social: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    async with engine_for(tokenizer, tmp_path) as engine, engine.requester("test") as requester:
        program = add(engine, social)
        with trio.fail_after(60):
            outcome = await engine.run_inferlet(program, json.dumps({"mode": "detacher"}))
            while engine.statistics().inferlets.terminated < 1:
                await trio.sleep(0.01)
            assert engine.statistics().inferlets.running == 1
            await requester.push("go", "now")
            assert await requester.pull("after") == "survived my parent"
            while engine.statistics().inferlets.running:
                await trio.sleep(0.01)
        stats = engine.statistics().inferlets
    assert outcome.ok and outcome.result == "parent done"
    assert (stats.returned, stats.terminated) == (2, 1)


@pytest.fixture(scope="module")
def misbehave(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "misbehave").read_bytes()


async def run_misbehave(wasm: bytes, request: dict[str, Any], **sandbox: Any) -> Any:
    config = with_overrides(EngineConfig(), sandbox=sandbox)
    async with open_engine(config, driver=SyntheticDriver()) as engine:
        program = engine.programs.add(wasm).hash
        with trio.fail_after(60):
            outcome = await engine.run_inferlet(program, json.dumps(request))
    assert outcome.ok, outcome.error
    return outcome


async def test_files_only_in_the_scratch_directory(misbehave: bytes, tmp_path: Path) -> None:
    cache = str(tmp_path / "components")
    scratch = tmp_path / "scratch"
    with_scratch = await run_misbehave(
        misbehave, {"mode": "files"}, cache_dir=cache, scratch_dir=str(scratch)
    )
    without = await run_misbehave(misbehave, {"mode": "files"}, cache_dir=cache)
    assert json.loads(with_scratch.result)["scratch"] == "written"
    assert list(scratch.iterdir()) == []
    assert json.loads(without.result)["scratch"] != "written"
    for outcome in (with_scratch, without):
        assert not json.loads(outcome.result)["etc"].startswith("read")


async def test_no_network(misbehave: bytes, tmp_path: Path) -> None:
    accepted: list[Any] = []
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def watch() -> None:
        accepted.append(await listeners[0].accept())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        outcome = await run_misbehave(
            misbehave, {"mode": "network", "port": port}, cache_dir=str(tmp_path)
        )
        # A connection the guest had made would wait in the backlog: `watch` takes it now.
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert outcome.result.startswith("refused")
    assert accepted == []
