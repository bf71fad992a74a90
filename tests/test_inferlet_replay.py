"""Recorded inferlets run again with no model and no network (`pie replay --inferlet`): examples
and a swarm agent replay exactly, a changed program is stopped at its first divergence with what
was expected and what was seen, and the recording caps cut a recording, which replay says.

One engine (synthetic driver, the default model's tokenizer) records every program once; the
tests replay from its log."""

from __future__ import annotations

import functools
import json
import math
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import wasmtime
from wasmtime.component import Record, Variant

from pie.cli import main
from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import open_engine
from pie.eventlog import read_log
from pie.eventlog.inferlet_replay import read_recording
from pie.events.inferlet import InferletOutcome
from pie.events.recording import HostCallsRecorded
from pie.sandbox import GuestStopped, WasmRuntime, callvalues
from pie.sandbox.callvalues import RecordedRaise
from pie.sandbox.recording import CHUNK_CALLS, RAW_CALLS, Chunk, Recorder, RecordingBudget
from pie.sandbox.replaying import Replayer
from pie.sandbox.values import Err, Ok
from pie.sandbox.wasm import record
from tests.inferlet_fixtures import EXAMPLES, GUESTS, REPO
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.test_inferlet_subscriptions import instance

WAT = (REPO / "tests" / "wat_guests" / "host_calls.wat").read_text()
SECOND_CREATE = (
    "        i32.const 1\n        i32.const 64\n        call $context_create\n        unreachable"
)
SWARM_AGENT = REPO / "scenarios" / "swarm" / "swarm-agent"
CLOCK_CALL = '<tool_call>{"name": "clock", "arguments": {}}</tool_call>'
PLANNER = {"role": "planner", "run": "r1"}
TEXT = {"prompt": "Tell me about dragons.", "max_tokens": 8, "stream": True}
TOOLS = {"task": "What time is it?", "prefill": CLOCK_CALL, "max_steps": 2, "max_tokens": 6}


@attrs.frozen
class Recorded:
    log: Path
    cache: Path
    """$PIE_CACHE_DIR of the engine: its compiled components are under components/."""
    outcomes: dict[str, InferletOutcome]
    programs: dict[str, Path]


def engine_config(tmp: Path, **event_log: Any) -> EngineConfig:
    return with_overrides(
        EngineConfig(),
        sandbox={"cache_dir": str(tmp / "cache" / "components")},
        event_log={"path": str(tmp / "events.jsonl"), "record_inferlets": True, **event_log},
    )


async def record_programs(
    tmp: Path, tokenizer: Tokenizer, wasm: dict[str, bytes]
) -> dict[str, InferletOutcome]:
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size)
    async with open_engine(engine_config(tmp), driver=driver, tokenizer=tokenizer) as engine:
        hashes = {name: engine.programs.add(data, name=name).hash for name, data in wasm.items()}

        async def run(name: str, request: Any) -> InferletOutcome:
            text = request if isinstance(request, str) else json.dumps(request)
            return await engine.run_inferlet(hashes[name], text)

        async with engine.requester() as requester:
            agent = await requester.launch(hashes["swarm-agent"], json.dumps(PLANNER))
            await requester.push("r1/task", "a short poem")
            with trio.fail_after(60):
                outcomes = {
                    "planner": await agent.outcome(),
                    "text": await run("text-completion", TEXT),
                    "tools": await run("function-calling", TOOLS),
                    "parent": await run("social", {"mode": "parent"}),
                    "wat": await run("wat", "c"),
                }
    return outcomes


@pytest.fixture(scope="module")
def recorded(
    built: Callable[[Path], Path],  # noqa: F811
    tokenizer: Tokenizer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Recorded:
    tmp = tmp_path_factory.mktemp("replay")
    programs = {
        "text-completion": built(EXAMPLES / "text-completion"),
        "function-calling": built(EXAMPLES / "function-calling"),
        "swarm-agent": built(SWARM_AGENT),
        "social": built(GUESTS / "social"),
        "wat": write_wat(tmp / "host_calls.wasm", WAT),
    }
    wasm = {name: path.read_bytes() for name, path in programs.items()}
    components = WasmRuntime(tmp / "cache" / "components").cache
    for data in wasm.values():
        components.load(data)  # compiled before any deadline starts
    outcomes = trio.run(record_programs, tmp, tokenizer, wasm)
    for name, outcome in outcomes.items():
        assert outcome.ok or name == "wat", (name, outcome.error)
    return Recorded(tmp / "events.jsonl", tmp / "cache", outcomes, programs)


def write_wat(path: Path, text: str) -> Path:
    path.write_bytes(bytes(wasmtime.wat2wasm(text)))
    return path


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No model can be built and no connection made from here on."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("replay must not build a driver, an engine or a connection")

    monkeypatch.setattr(SyntheticDriver, "__init__", refuse)
    monkeypatch.setattr("pie.drivers.factory.build_drivers", refuse)
    monkeypatch.setattr("pie.engine.Engine.__init__", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def replay(
    recorded: Recorded,
    name: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *extra: str,
) -> tuple[int, str]:
    monkeypatch.setenv("PIE_CACHE_DIR", str(recorded.cache))
    instance = recorded.outcomes[name].instance
    code = main(["replay", str(recorded.log), "--inferlet", instance, *extra])
    return code, capsys.readouterr().out


def calls(recorded: Recorded, name: str) -> tuple[Any, ...]:
    """The recorded [function, arguments, result] of each host call of `name`'s instance."""
    return read_recording(recorded.log, recorded.outcomes[name].instance).calls


def functions(recorded: Recorded, name: str) -> set[str]:
    return {call[0] for call in calls(recorded, name)}


@pytest.mark.integration
@pytest.mark.usefixtures("offline")
def test_text_completion_replays_exactly_with_no_model_and_no_network(
    recorded: Recorded, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = replay(recorded, "text", capsys, monkeypatch)
    result = recorded.outcomes["text"].result or ""
    assert code == 0, out
    assert out.count(f"returned {result}") == 2  # as recorded and as replayed
    assert "exact replay" in out and "calls/s" in out
    sent = [args[0] for fn, args, _ in calls(recorded, "text") if fn == "session.send"]
    assert "".join(sent) == result  # as the program streamed it
    assert {"model.load", "generate.start", "futures.poll"} <= functions(recorded, "text")


@pytest.mark.integration
@pytest.mark.usefixtures("offline")
def test_a_swarm_agent_replays_its_bus_messages(
    recorded: Recorded, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = replay(recorded, "planner", capsys, monkeypatch)
    assert code == 0, out
    bus = {"messaging.push", "messaging.pull", "messaging.message", "messaging.broadcast"}
    assert bus <= functions(recorded, "planner")
    pulled = [got for fn, _, got in calls(recorded, "planner") if fn == "messaging.message"]
    assert pulled == [{"ok": "a short poem"}]


@pytest.mark.integration
@pytest.mark.usefixtures("offline")
def test_function_calling_replays_the_tool_result_and_the_clock_it_read(
    recorded: Recorded, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = replay(recorded, "tools", capsys, monkeypatch)
    steps = json.loads(recorded.outcomes["tools"].result or "")["steps"]
    assert steps[0]["call"] == {"name": "clock", "arguments": {}}
    assert code == 0, out
    # The tool read the wall clock through WASI; replay answered with the recorded time.
    assert "wall-clock.now" in functions(recorded, "tools")


@pytest.mark.integration
@pytest.mark.usefixtures("offline")
def test_children_and_a_queue_replay_in_the_parent(
    recorded: Recorded, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = replay(recorded, "parent", capsys, monkeypatch)
    assert code == 0, out
    assert {"runtime.launch", "runtime.wait", "runtime.child-result"} <= functions(
        recorded, "parent"
    )


@pytest.mark.integration
def test_an_edited_program_stops_at_its_first_divergence(
    recorded: Recorded,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    same = replay(recorded, "wat", capsys, monkeypatch)
    changed = WAT.replace(SECOND_CREATE, SECOND_CREATE.replace("i32.const 1", "i32.const 2"))
    assert changed != WAT
    edited = write_wat(tmp_path / "edited.wasm", changed)
    code, out = replay(recorded, "wat", capsys, monkeypatch, "--program", str(edited))
    assert same[0] == 0, same[1]
    assert code == 1, out
    assert "(recorded: " in out
    assert "diverged at call 1 (of 2 recorded)" in out
    assert "expected: context.create [1]" in out
    assert "seen:     context.create [2]" in out


@pytest.mark.integration
def test_a_log_without_the_recording_cannot_be_replayed(
    recorded: Recorded, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    instance = recorded.outcomes["text"].instance
    first_chunk = f'"HostCallsRecorded","instance":"{instance}","first":0,'
    text = recorded.log.read_text()
    assert first_chunk in text
    holed = tmp_path / "holed.jsonl"
    holed.write_text(text.replace(first_chunk, first_chunk.replace(":0,", ":5,")))
    program = str(recorded.programs["text-completion"])
    unknown = main(["replay", str(recorded.log), "--inferlet", "i999"])
    err = capsys.readouterr().err
    cut = main(["replay", str(holed), "--inferlet", instance, "--program", program])
    out = capsys.readouterr().out
    assert (unknown, cut) == (2, 2)
    assert "no recording of inferlet i999; recorded: i1" in err
    assert "cannot replay past call 0: calls 0 to 4 are not in the log" in out


def run_capped(tmp: Path, users: list[str], **caps: float) -> list[InferletOutcome]:
    return trio.run(functools.partial(record_capped, tmp, users, **caps))


async def record_capped(tmp: Path, users: list[str], **caps: float) -> list[InferletOutcome]:
    config = engine_config(tmp, **caps)
    async with open_engine(config, driver=SyntheticDriver()) as engine:
        program = engine.programs.add(bytes(wasmtime.wat2wasm(WAT))).hash
        with trio.fail_after(30):
            return [await engine.run_inferlet(program, "c", user=user) for user in users]


def chunks(log: Path) -> dict[str, list[HostCallsRecorded]]:
    found: dict[str, list[HostCallsRecorded]] = {}
    for envelope in read_log(log):
        if isinstance(envelope.event, HostCallsRecorded):
            found.setdefault(envelope.event.instance, []).append(envelope.event)
    return found


@pytest.mark.integration
def test_the_recording_cap_cuts_a_recording_and_replay_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    one_call = 40 / (1 << 20)  # room for the first `context.create` only
    (outcome,) = run_capped(tmp_path, ["ann"], record_max_mb=one_call)
    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    code = main(["replay", str(tmp_path / "events.jsonl"), "--inferlet", outcome.instance])
    out = capsys.readouterr().out
    (cut, final) = chunks(tmp_path / "events.jsonl")[outcome.instance]
    # The program itself ran on as it would have: only its recording stopped.
    assert outcome.status == "trapped" and "unreachable" in (outcome.error or "")
    assert json.loads(cut.calls) == [["context.create", [1], {"ok": 1}]]
    assert "record_max_mb" in cut.stopped and final.final
    assert code == 2, out
    assert "cannot replay past call 1: the recording stopped there" in out


@pytest.mark.integration
def test_a_users_recordings_stop_at_their_cap_and_another_users_are_whole(
    tmp_path: Path,
) -> None:
    budget = 70 / (1 << 20)  # two calls, then ann's budget is spent
    outcomes = run_capped(tmp_path, ["ann", "ann", "bob"], record_user_mb=budget)
    recordings = [read_recording(tmp_path / "events.jsonl", o.instance) for o in outcomes]
    assert [o.status for o in outcomes] == ["trapped"] * 3
    assert [len(r.calls) for r in recordings] == [2, 0, 2]
    assert (recordings[0].cut, recordings[2].cut) == (None, None)
    assert "user 'ann''s recordings reached record_user_mb" in (recordings[1].cut or "")


VALUES = [
    None,
    7,
    -2.5,
    "héllo",
    b"\x00\xffbytes",
    [1, 2, 3],
    (4, 5, 6),
    Ok([Variant("token", 3), Variant("logits", [0.5, -math.inf])]),
    Err(record(kind="invalid", message="no")),
    record(tokens=[1, 2], probs=[0.25, 0.75], inner=record(hash="ab", grid=(1, 2, 3))),
]


@pytest.mark.unit
@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_host_values_survive_the_json_codec(value: Any) -> None:
    text = callvalues.dumps(callvalues.encode(value))
    back = callvalues.decode(json.loads(text))
    assert callvalues.dumps(callvalues.encode(back)) == text
    assert type(back) is type(value)


@pytest.mark.unit
@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_a_call_is_written_as_the_walk_of_its_values_would_write_it(value: Any) -> None:
    walked = callvalues.dumps(["f.g", callvalues.encode_args((value, 1)), callvalues.encode(value)])
    tupled = "tuple" in walked
    name = next(iter(callvalues.TUPLE_CALLS)) if tupled else "f.g"
    assert callvalues.dumps_call(name, (value, 1), value) == walked.replace("f.g", name)


@pytest.mark.unit
def test_the_calls_walked_for_tuples_are_those_whose_wit_types_hold_one() -> None:
    wit = (REPO / "sdk" / "wit" / "inferlet.wit").read_text()
    holding = {"tuple"}
    types = dict(re.findall(r"(?:record|variant) ([\w-]+) \{(.*?)\n    \}", wit, re.S))
    types.update(re.findall(r"type ([\w-]+) = ([^;]+);", wit))
    while True:
        more = {n for n, body in types.items() if _names_any(body, holding)}
        if more <= holding:
            break
        holding |= more
    calls = set()
    for interface, body in re.findall(r"interface ([\w-]+) \{(.*?)\n\}", wit, re.S):
        for fn, signature in re.findall(r"([\w-]+): func(\(.*?\)(?: -> [^;]+)?);", body):
            if _names_any(signature, holding):
                calls.add(f"{interface}.{fn}")
    assert calls == set(callvalues.TUPLE_CALLS)


def _names_any(text: str, names: set[str]) -> bool:
    return any(re.search(rf"\b{name}\b", text) for name in names)


@pytest.mark.unit
def test_calls_are_kept_as_made_and_encoded_together_raw_calls_at_a_time() -> None:
    sent: list[Chunk] = []
    recorder = Recorder(sent.append, max_bytes=1 << 20, budget=RecordingBudget(1 << 20), user="a")
    recorder.add("model.encode", (1, "word"), Ok([5]))
    assert recorder.calls == 1 and recorder._pending == []  # kept as made
    recorder.encode_pending()
    assert recorder._pending == ['["model.encode",[1,"word"],{"ok":[5]}]']
    for n in range(RAW_CALLS):
        recorder.add("model.encode", (1, str(n)), Ok([n]))
    assert len(recorder._pending) == 2 and recorder.calls == 1 + RAW_CALLS  # one piece of 64
    recorder.close()
    assert len(json.loads(sent[-1].calls)) == 1 + RAW_CALLS and sent[-1].final


@pytest.mark.unit
def test_calls_encoded_together_read_as_each_encoded_alone() -> None:
    media = Record()
    media.kind, media.frames, media.grid = "image", 1, (2, 3)
    calls = [
        ("model.encode", (1, "word"), Ok([5])),
        ("futures.poll", ([3],), RecordedRaise.of(GuestStopped("timeout", "out of time"))),
        ("forward.step", (_step_args(),), Ok([Variant("token", 7)])),
    ]
    alone = [callvalues.dumps_call(*call) for call in calls]
    assert callvalues.dumps_calls(calls) == "[" + ",".join(alone) + "]"
    with_tuple = [*calls, ("media.info", (4,), Ok(media))]  # walked, so that its tuple is tagged
    together = json.loads(callvalues.dumps_calls(with_tuple))
    assert together[-1] == ["media.info", [4], {"ok": callvalues.encode(media)}]
    assert together[-1][2]["ok"]["record"]["grid"] == {"tuple": [2, 3]}


def _step_args() -> Record:
    slot = Record()
    slot.index, slot.op = 0, Variant("argmax", None)
    args = Record()
    args.context, args.tokens, args.slots, args.adapter = 7, [203], [slot], None
    return args


@pytest.mark.unit
def test_a_cap_inside_calls_encoded_together_cuts_at_the_call_that_crosses_it() -> None:
    sent: list[Chunk] = []
    one = len('["model.encode",[1,"0"],{"ok":[0]}]') + 1
    recorder = Recorder(sent.append, max_bytes=3 * one, budget=RecordingBudget(1 << 20), user="a")
    for n in range(5):
        recorder.add("model.encode", (1, str(n)), Ok([n]))
    recorder.close()
    assert [c[1][1] for c in json.loads(sent[0].calls)] == ["0", "1", "2"]
    assert "record_max_mb" in sent[0].stopped and recorder.calls == 3


@pytest.mark.unit
def test_a_guest_waiting_long_has_its_calls_encoded_meanwhile_and_a_short_wait_does_not() -> None:
    state = instance()  # an instance whose requests are answered at once
    encoded: list[float] = []
    state.while_idle = (0.05, lambda: encoded.append(time.monotonic()))
    handle, fill = state.expect("reply")
    threading.Timer(0.01, fill, args=("quick",)).start()
    assert state.wait_any([handle]) == [0] and encoded == []  # over before it was idle
    handle, fill = state.expect("reply")
    started = time.monotonic()
    threading.Timer(0.3, fill, args=("slow",)).start()
    assert state.wait_any([handle]) == [0]
    assert len(encoded) == 1 and 0.04 < encoded[0] - started < 0.25


@pytest.mark.unit
def test_numpy_values_are_recorded_as_the_lists_they_lower_to() -> None:
    encoded = callvalues.encode(Ok(np.array([0.5, 1.25], dtype=np.float32)))
    assert encoded == {"ok": [0.5, 1.25]}
    assert callvalues.encode(np.uint32(7)) == 7


@pytest.mark.unit
def test_a_value_host_calls_never_carry_is_refused() -> None:
    with pytest.raises(callvalues.Unrecordable, match="set"):
        callvalues.encode({1, 2})
    assert isinstance(callvalues.decode({"record": {"a": 1}}), Record)


@pytest.mark.unit
def test_a_recorder_sends_full_chunks_then_a_final_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pie.sandbox.recording.CHUNK_SECONDS", math.inf)
    sent: list[Chunk] = []
    budget = RecordingBudget(1 << 20)
    recorder = Recorder(sent.append, max_bytes=1 << 20, budget=budget, user="ann")
    for n in range(CHUNK_CALLS + 3):
        recorder.add("model.encode", (1, f"word {n}"), Ok([n]))
    recorder.close()
    assert [(c.first, len(json.loads(c.calls)), c.final) for c in sent] == [
        (0, CHUNK_CALLS, False),
        (CHUNK_CALLS, 3, True),
    ]
    assert json.loads(sent[1].calls)[-1] == ["model.encode", [1, "word 258"], {"ok": [258]}]


@pytest.mark.unit
def test_a_call_that_raised_is_replayed_as_the_same_stop() -> None:
    sent: list[Chunk] = []
    recorder = Recorder(sent.append, max_bytes=1 << 20, budget=RecordingBudget(1 << 20), user="a")
    recorder.add_raise("futures.poll", ([3],), GuestStopped("timeout", "out of time"))
    recorder.close()
    replayer = Replayer(json.loads(sent[0].calls))
    with pytest.raises(GuestStopped) as stopped:
        replayer.answer("futures.poll", ([3],))
    assert (stopped.value.status, stopped.value.reason) == ("timeout", "out of time")
