"""The WebSocket server seen through raw frames: requests answered by correlation id, bad frames
refused without closing, uploads checked, inferlet events streamed, re-attached, owned and
retained, and a graceful stop that loses no completed result. Synthetic driver throughout."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import ConnectionClosed

from pie.config import EngineConfig, with_overrides
from pie.events import inferlet as ev
from pie.wire import messages as msg
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import PYTEST_CACHE, Raw, connect, serving

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def relay(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "relay").read_bytes()


async def install(raw: Raw, wasm: bytes, name: str, chunk: int = 1 << 20) -> msg.ProgramFound:
    digest = hashlib.sha256(wasm).hexdigest()
    pieces = [wasm[i : i + chunk] for i in range(0, len(wasm), chunk)]
    for index, data in enumerate(pieces):
        reply = await raw.call(
            msg.UploadProgram,
            name=name,
            version="1.0",
            hash=digest,
            size=len(wasm),
            index=index,
            count=len(pieces),
            data=data,
        )
        if index < len(pieces) - 1:
            assert reply == msg.UploadProgress(corr=raw.corr, received=(index + 1) * chunk)
    assert isinstance(reply, msg.ProgramFound), reply
    return reply


async def test_the_first_frame_is_a_welcome_and_bad_frames_leave_the_connection_open(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path) as server, await connect(server.url) as ws:
        raw = Raw(ws)
        with trio.fail_after(30):
            welcome = await raw.next()
            assert isinstance(welcome, msg.Welcome)
            assert welcome.protocol == msg.PROTOCOL_VERSION and not welcome.auth_required
            for frame in ["not json", "[1,2]", '{"type": "Nope", "corr": 4}']:
                await ws.send_message(frame)
                failure = await raw.next()
                assert isinstance(failure, msg.Failure) and failure.kind == "bad-frame"
            await ws.send_message('{"type": "Launch", "corr": 9, "program": 5}')
            failure = await raw.next()
            assert (failure.corr, failure.kind) == (9, "bad-frame")
            assert "program" in failure.message
            found = await raw.call(msg.QueryProgram, program="nothing-here")
            assert found.kind == "no-such-program"
            status = await raw.call(msg.QueryStatistics)
            assert isinstance(status, msg.EngineStatus) and status.pages_free > 0
            assert status.driver_threads == server.engine.info.threads == 1


async def test_uploads_are_checked_chunk_by_chunk_and_by_hash(tmp_path: Path, relay: bytes) -> None:
    async with serving(tmp_path, max_program_mb=64) as server, await connect(server.url) as ws:
        raw = Raw(ws)
        with trio.fail_after(120):
            await raw.next()
            found = await install(raw, relay, "relay")
            assert found.hash == hashlib.sha256(relay).hexdigest() and found.size == len(relay)
            again = await raw.call(msg.QueryProgram, program="relay@1.0")
            assert again.hash == found.hash
            fields = dict(name="x", version="1", size=4, count=1, data=b"abcd")
            wrong = await raw.call(msg.UploadProgram, hash="0" * 64, index=0, **fields)
            assert wrong.kind == "hash-mismatch"
            late = await raw.call(msg.UploadProgram, hash="1" * 64, index=1, **fields)
            assert late.kind == "bad-upload"
            huge = await raw.call(
                msg.UploadProgram, hash="2" * 64, index=0, **{**fields, "size": 65 << 20}
            )
            assert huge.kind == "too-large"
            broken = b"\0asm\x0d\x00\x01\x00garbage"
            digest = hashlib.sha256(broken).hexdigest()
            invalid = await raw.call(
                msg.UploadProgram,
                name="broken",
                version="1",
                hash=digest,
                size=len(broken),
                index=0,
                count=1,
                data=broken,
            )
            assert invalid.kind == "invalid-program", invalid


async def test_a_launch_streams_events_and_a_reattach_replays_what_was_missed(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                launched = await raw.call(msg.Launch, program="relay", input='{"mode":"relay"}')
                instance = launched.instance
                assert isinstance(
                    await raw.call(msg.SendMessage, instance=instance, text="a"), msg.Done
                )
                while not isinstance(getattr(await raw.next(), "event", None), ev.SessionMessage):
                    pass
            # The connection is gone; the inferlet lives on and a second message is answered.
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                listing = await raw.call(msg.ListInferlets)
                assert [(i.instance, i.attached) for i in listing.inferlets] == [(instance, False)]
                assert isinstance(await raw.call(msg.Attach, instance=instance, after=0), msg.Done)
                await raw.call(msg.SendMessage, instance=instance, text="b")
                await raw.call(msg.SendMessage, instance=instance, text="bye")
                seen = await raw.until_end(instance)
        assert [m.seq for m in seen] == list(range(1, len(seen) + 1))
        replies = [m.event.text for m in seen if isinstance(m.event, ev.SessionMessage)]
        assert replies == ["1:a", "2:b"]
        assert isinstance(seen[0].event, ev.InferletStarted)
        assert seen[-1].event == ev.InferletReturned(
            instance=instance, result="2", seconds=seen[-1].event.seconds
        )


async def test_messages_sent_to_a_queued_inferlet_reach_it_when_it_starts(
    tmp_path: Path, relay: bytes
) -> None:
    components = str(PYTEST_CACHE / "pie-components")
    config = with_overrides(
        EngineConfig(), sandbox={"cache_dir": components, "max_running_per_user": 1}
    )
    async with serving(tmp_path, config=config) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                first = await raw.call(msg.Launch, program="relay", input='{"mode":"relay"}')
                queued = await raw.call(msg.Launch, program="relay", input='{"mode":"relay"}')
                for text in ["while queued", "bye"]:
                    sent = await raw.call(msg.SendMessage, instance=queued.instance, text=text)
                    assert isinstance(sent, msg.Done), sent
                await raw.call(msg.SendMessage, instance=first.instance, text="bye")
                ends: dict[str, Any] = {}
                replies: dict[str, list[str]] = {first.instance: [], queued.instance: []}
                while len(ends) < 2:
                    message = await raw.next()
                    if not isinstance(message, msg.InferletEvent):
                        continue
                    if isinstance(message.event, ev.SessionMessage):
                        replies[message.instance].append(message.event.text)
                    elif isinstance(message.event, ev.InferletEnd):
                        ends[message.instance] = message.event
        assert replies == {first.instance: [], queued.instance: ["1:while queued"]}
        assert [ends[i].result for i in (first.instance, queued.instance)] == ["0", "1"]


async def test_an_ended_inferlet_is_retained_for_a_late_reattach_with_after(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                launched = await raw.call(
                    msg.Launch, program="relay", input=json.dumps({"mode": "count", "n": 5})
                )
                first = await raw.next()
                assert first.seq == 1
            while server.hub.live_instances():
                await trio.sleep(0.01)
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                await raw.call(msg.Attach, instance=launched.instance, after=3)
                rest = await raw.until_end(launched.instance)
        assert [m.seq for m in rest] == [4, 5, 6, 7]
        assert [m.event.text for m in rest[:3]] == ["2", "3", "4"]
        assert rest[-1].event.result == "counted"


async def test_an_inferlet_left_alone_is_terminated_after_orphan_seconds(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path, orphan_seconds=0) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                await raw.call(msg.Launch, program="relay", input='{"mode":"relay"}')
            while server.engine.statistics().inferlets.terminated < 1:
                await trio.sleep(0.01)
        assert server.statistics().inferlets_live == 0


async def test_another_user_can_neither_see_nor_stop_nor_attach(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with await connect(server.url) as a, await connect(server.url) as b:
                alice, bob = Raw(a), Raw(b)
                await alice.next(), await bob.next()
                await alice.call(msg.Authenticate, user="alice")
                await bob.call(msg.Authenticate, user="bob")
                launched = await alice.call(msg.Launch, program="relay", input='{"mode":"relay"}')
                instance = launched.instance
                assert (await bob.call(msg.ListInferlets)).inferlets == ()
                for make, extra in [
                    (msg.Terminate, {}),
                    (msg.Attach, {"after": 0}),
                    (msg.SendMessage, {"text": "hi"}),
                ]:
                    refused = await bob.call(make, instance=instance, **extra)
                    assert refused.kind == "not-owner"
                assert (await bob.call(msg.Terminate, instance="i999")).kind == "no-such-inferlet"
                await alice.call(msg.Terminate, instance=instance)
                end = (await alice.until_end(instance))[-1].event
        assert isinstance(end, ev.InferletTerminated)


async def test_named_contexts_of_one_user_are_invisible_to_another(
    tmp_path: Path, relay: bytes
) -> None:
    async def run(raw: Raw, request: dict[str, Any]) -> Any:
        launched = await raw.call(msg.Launch, program="relay", input=json.dumps(request))
        return (await raw.until_end(launched.instance))[-1].event.result

    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with await connect(server.url) as a, await connect(server.url) as b:
                alice, bob = Raw(a), Raw(b)
                await alice.next(), await bob.next()
                await alice.call(msg.Authenticate, user="alice")
                await bob.call(msg.Authenticate, user="bob")
                saved = await run(alice, {"mode": "save", "name": "notes", "text": "x y z"})
                assert await run(alice, {"mode": "open", "name": "notes"}) == saved
                theirs = await run(bob, {"mode": "open", "name": "notes"})
        assert theirs.startswith("error: no-such-snapshot"), theirs


async def test_stopping_under_load_delivers_every_completed_result(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(90):
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                instances = []
                for _ in range(6):
                    request = json.dumps({"mode": "count", "n": 200})
                    instances.append(
                        (await raw.call(msg.Launch, program="relay", input=request)).instance
                    )
                waiting = await raw.call(msg.Launch, program="relay", input='{"mode":"relay"}')
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(server.stop, 2.0)
                    ends: dict[str, Any] = {}
                    try:
                        while True:
                            message = await raw.next()
                            if isinstance(message, msg.InferletEvent) and isinstance(
                                message.event, ev.InferletEnd
                            ):
                                ends[message.instance] = message.event
                    except ConnectionClosed as closed:
                        assert closed.reason.code == 1001
        assert all(isinstance(ends[i], ev.InferletReturned) for i in instances)
        assert isinstance(ends[waiting.instance], ev.InferletTerminated)
        later = await _refused_after_stop(server.url)
        assert later


async def _refused_after_stop(url: str) -> bool:
    try:
        async with await connect(url) as ws:
            await ws.get_message()
    except (ConnectionClosed, OSError, Exception):
        return True
    return False


async def test_the_event_log_holds_every_result_once_the_server_has_stopped(
    tmp_path: Path, relay: bytes
) -> None:
    log = tmp_path / "events.jsonl"
    config = with_overrides(
        EngineConfig(),
        event_log={"path": str(log)},
        sandbox={"cache_dir": str(PYTEST_CACHE / "pie-components")},
    )
    async with serving(tmp_path, config=config) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                request = json.dumps({"mode": "count", "n": 3})
                launched = await raw.call(msg.Launch, program="relay", input=request)
                await raw.until_end(launched.instance)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    returned = [e for e in lines if e["event"]["type"] == "InferletReturned"]
    assert [e["event"]["instance"] for e in returned] == [launched.instance]


async def test_a_client_that_stops_reading_is_disconnected_and_its_inferlet_carries_on(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path, send_buffer=64) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(90):
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                request = json.dumps({"mode": "count", "n": 30000})
                launched = await raw.call(msg.Launch, program="relay", input=request)
                # Reads nothing more: the socket buffers fill, then the server's outbox.
                while server.statistics().connections:
                    await trio.sleep(0.05)
                assert server.hub.live_instances() == [launched.instance]
            while server.hub.live_instances():
                await trio.sleep(0.05)
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                await raw.call(msg.Attach, instance=launched.instance, after=29990)
                rest = await raw.until_end(launched.instance)
        assert rest[-1].event.result == "counted"
