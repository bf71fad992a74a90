"""Typed mailboxes: each address accepts one closed union of event types, anything else is
refused at the sender (not logged, not delivered), and every address the engine wires says
what it accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import wasmtime

from pie.actors.inferlet.actor import PROGRAM_INBOX
from pie.actors.requester import REPLIES
from pie.actors.runtime import Router, UnexpectedEvent, event_types
from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import open_engine
from pie.eventlog import EventLog
from pie.events import ALL_EVENTS, bus, kv
from pie.events.batching import ScheduleForward
from pie.events.speculation import LanePassApplied, LeaseReleased

GUEST = Path(__file__).parent / "wat_guests" / "host_calls.wat"
REFUSED = "the mailbox at 'box' does not accept Pulled; it accepts Done, RequestFailed"


def replies_box() -> tuple[Router, EventLog, trio.MemoryReceiveChannel[Any]]:
    log = EventLog()
    router = Router(log)
    return router, log, router.register("box", kv.Done | kv.RequestFailed)


def pulled() -> bus.Pulled:
    return bus.Pulled(corr=1, queue="q", message="m")


@pytest.mark.unit
async def test_an_accepted_event_is_delivered_and_logged() -> None:
    router, log, inbox = replies_box()
    await router.send("a", "box", kv.Done(corr=1))
    assert router.send_nowait("a", "box", kv.RequestFailed(corr=2, kind="busy", message="m"))
    assert inbox.receive_nowait() == (1, kv.Done(corr=1))
    seq, failed = inbox.receive_nowait()
    assert seq == 2 and failed.kind == "busy"
    assert [r.corr for r in log.records()] == [1, 2]


@pytest.mark.unit
async def test_send_refuses_an_event_the_mailbox_does_not_accept() -> None:
    router, log, inbox = replies_box()
    with pytest.raises(UnexpectedEvent) as refused:
        await router.send("a", "box", pulled())
    assert str(refused.value) == REFUSED
    assert isinstance(refused.value, TypeError)
    with pytest.raises(trio.WouldBlock):
        inbox.receive_nowait()
    assert len(log) == 0
    assert [m.received for m in router.statistics()] == [0]


@pytest.mark.unit
def test_send_nowait_refuses_it_too() -> None:
    router, log, inbox = replies_box()
    with pytest.raises(UnexpectedEvent, match="does not accept Pulled"):
        router.send_nowait("a", "box", pulled())
    with pytest.raises(trio.WouldBlock):
        inbox.receive_nowait()
    assert len(log) == 0


@pytest.mark.unit
def test_a_handler_address_refuses_before_its_handler_runs() -> None:
    log = EventLog()
    router = Router(log)
    handled: list[Any] = []
    router.register_handler("box", kv.Done | kv.RequestFailed, handled.append)
    with pytest.raises(UnexpectedEvent, match=REFUSED):
        router.send_nowait("a", "box", pulled())
    assert handled == [] and len(log) == 0
    assert router.send_nowait("a", "box", kv.Done(corr=7))
    assert handled == [kv.Done(corr=7)] and len(log) == 1


@pytest.mark.unit
def test_classes_unions_and_tuples_flatten_into_one_tuple() -> None:
    flat = event_types((kv.KvCommand, LanePassApplied, (kv.SubmitForward, LeaseReleased)))
    assert flat[0] is kv.CreateContext and flat[-1] is LeaseReleased
    assert flat.count(kv.SubmitForward) == 1 and LanePassApplied in flat
    assert event_types(ScheduleForward) == (ScheduleForward,)


@pytest.mark.unit
def test_a_mailbox_must_accept_something_and_only_classes() -> None:
    router = Router()
    with pytest.raises(ValueError, match="accepts no event type"):
        router.register("empty", ())
    with pytest.raises(TypeError, match="not an event class"):
        router.register("typo", "Done")
    assert "empty" not in router and "typo" not in router


@pytest.mark.unit
def test_what_a_program_accepts_extends_what_a_requester_accepts() -> None:
    program = set(event_types(PROGRAM_INBOX))
    assert set(event_types(REPLIES)) < program
    assert program <= set(ALL_EVENTS)


@pytest.mark.integration
async def test_every_address_the_engine_wires_declares_the_events_it_accepts(
    tmp_path: Path,
) -> None:
    config = with_overrides(EngineConfig(), sandbox={"cache_dir": str(tmp_path)})
    async with (
        open_engine(config, driver=SyntheticDriver()) as engine,
        engine.requester("cli") as requester,
    ):
        program = engine.programs.add(bytes(wasmtime.wat2wasm(GUEST.read_text())), name="g").hash
        run = await requester.launch(program, "p")  # "p" waits for a session message
        instance = f"inferlet:{run.instance}"
        with trio.fail_after(5):
            while instance not in engine.router:
                await trio.sleep(0.01)
        wired = {m.address: engine.router.accepts(m.address) for m in engine.router.statistics()}
        await run.send(text="wake up")
        with trio.fail_after(5):
            outcome = await run.outcome()
    assert outcome.ok
    assert set(wired) == {
        *("kv", "inference", "inference.former", "bus", "http", "mcp", "inferlets"),
        *("cli", instance),
    }
    for address, accepted in wired.items():
        assert accepted, address
        assert set(accepted) <= set(ALL_EVENTS), address
    assert wired["inference"] == (ScheduleForward,)
    assert {kv.SubmitForward, LanePassApplied} <= set(wired["kv"])
    assert wired[instance] == event_types(PROGRAM_INBOX)
