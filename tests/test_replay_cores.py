"""Every pure core replayed from one recorded run: the kv core, the bus, the inferlet lifecycle
(with its program bindings) and the batch former (with the clock readings it saw) replay
exactly, and a log whose record was changed is caught."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import wasmtime

from pie.config import EngineConfig, with_overrides
from pie.dataplane.former import BatchPolicy
from pie.dataplane.tape import RecordingFormer
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import open_engine
from pie.engine.replay import NotReplayable, replay_cores
from pie.eventlog import Envelope, read_log
from pie.events import bus
from pie.events.batching import EngineStarted, FormerNext, FormerSteps, ScheduleForward
from pie.events.forward import ForwardRequest
from pie.events.sampling import Argmax, SamplingSlot

pytestmark = pytest.mark.integration

GUEST = Path(__file__).parent / "wat_guests" / "host_calls.wat"
GREEDY = (SamplingSlot(index=0, op=Argmax()),)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> list[Envelope]:
    """A run with concurrent decodes (batched by the former), bus traffic, a refused pull
    overrun and an inferlet that waits for a message."""
    folder = tmp_path_factory.mktemp("replay-cores")
    path = folder / "events.jsonl"
    config = with_overrides(
        EngineConfig(),
        event_log={"path": str(path)},
        sandbox={"cache_dir": str(folder / "components")},
        bus={"max_waiting_pulls": 1},
        scheduler={"fast_path": False},
    )

    async def run() -> None:
        with trio.fail_after(20):
            async with open_engine(config, driver=SyntheticDriver(pass_seconds=0.002)) as engine:
                program = engine.programs.add(bytes(wasmtime.wat2wasm(GUEST.read_text())), "g")
                async with engine.requester("client") as client:
                    launched = await client.launch(program.hash, "p")
                    async with trio.open_nursery() as nursery:
                        for start in range(0, 40, 10):
                            nursery.start_soon(decode, engine, start)
                        await client.push("q", "hello")
                        assert await client.pull("q") == "hello"
                    await launched.send(text="wake up")
                    assert (await launched.outcome()).ok

    trio.run(run)
    return list(read_log(path))


async def decode(engine: Any, start: int) -> None:
    async with engine.requester() as r:
        context = await r.create_context()
        out = await r.forward(context, [start, start + 1], (SamplingSlot(index=1, op=Argmax()),))
        for _ in range(6):
            out = await r.forward(context, [out[0].token], GREEDY)


def test_every_core_replays_exactly(recorded: list[Envelope]) -> None:
    replays = {done.name: done for done in replay_cores(recorded)}
    assert list(replays) == ["kv", "bus", "inferlets", "inference.former"]
    for done in replays.values():
        assert done.result.exact, (done.name, done.result.mismatches)
        assert done.result.inputs > 0 and done.result.outputs > 0, done.name
    assert "launched 1, returned 1" in replays["inferlets"].summary
    assert "passes" in replays["inference.former"].summary
    formed = [
        step
        for env in recorded
        if isinstance(env.event, FormerSteps)
        for step in env.event.steps
        if isinstance(step, FormerNext) and len(step.requests) > 1
    ]
    assert formed, "the four decoders were never batched together"


def test_a_changed_clock_reading_changes_the_formers_decisions() -> None:
    """Two contexts decode; after a pass, the former waits for both to come back until its
    watchdog (one pass time) runs out. Recorded, the waiting replays exactly; with the clock
    reading of a wait moved past the watchdog, replay fires a pass where the run formed none."""
    steps: list[Any] = []
    former = RecordingFormer(BatchPolicy(), lambda recorded: steps.extend(recorded))
    requests = {corr: _decode(corr, context) for corr, context in ((1, 1), (2, 2), (3, 1))}
    former.submit(requests[1], now=0.0)
    former.submit(requests[2], now=0.0)
    assert former.next_batch(0.0) is not None
    former.pass_finished(0.010, now=0.010)
    former.submit(requests[3], now=0.012)  # context 2 has not come back yet
    assert former.next_batch(0.012) is None  # the watchdog waits until 0.020
    former.flush()
    log = _log(requests, steps)
    (exact,) = replay_cores(log, "former")
    assert exact.result.exact and exact.result.outputs == 2

    waited = len(steps) - 1
    assert isinstance(steps[waited], FormerNext) and steps[waited].batch == 0
    steps[waited] = attrs.evolve(steps[waited], now=0.050)
    (changed,) = replay_cores(_log(requests, steps), "former")
    assert not changed.result.exact
    assert changed.result.mismatches[0].startswith(f"step {waited}: next pass: recorded")


def _decode(corr: int, context: int) -> ForwardRequest:
    return ForwardRequest(
        corr=corr, requester="a", context=context, tokens=(7,), positions=(0,), kv_start=0,
        pages=(context,), slots=GREEDY,
    )  # fmt: skip


def _log(requests: dict[int, ForwardRequest], steps: list[Any]) -> list[Envelope]:
    started = EngineStarted(
        model="m", vocab_size=10, page_size=4, num_pages=8, max_batch_tokens=512,
        max_batch_requests=64,
    )  # fmt: skip
    events: list[tuple[str, str, Any]] = [("engine", "engine", started)]
    events += [("kv", "inference", ScheduleForward(request=r)) for r in requests.values()]
    events.append(("inference", "inference.former", FormerSteps(model="m", steps=tuple(steps))))
    return [
        Envelope(seq=seq, time=0.0, src=src, dst=dst, corr=None, event=event)
        for seq, (src, dst, event) in enumerate(events, start=1)
    ]


def test_a_changed_bus_reply_is_a_mismatch(recorded: list[Envelope]) -> None:
    changed = [
        attrs.evolve(env, event=attrs.evolve(env.event, message="goodbye"))
        if isinstance(env.event, bus.Pulled)
        else env
        for env in recorded
    ]
    (replayed,) = replay_cores(changed, "bus")
    assert not replayed.result.exact and "goodbye" in replayed.result.mismatches[0]


def test_a_log_without_its_start_records_is_not_replayable(recorded: list[Envelope]) -> None:
    with pytest.raises(NotReplayable, match="EngineStarted"):
        replay_cores([env for env in recorded if env.src != "engine"])
