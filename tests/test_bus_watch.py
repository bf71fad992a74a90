"""Clients on the messaging bus: a client watches topics inferlets broadcast on, and broadcasts
and pushes messages inferlets act on; bad names are refused; a watch ends when it is stopped or
its connection closes; unread messages overflow; the blocking client and the bus commands.
Synthetic driver throughout."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.cli import client as client_cli
from pie.client import (
    PieError,
    ServerError,
    SessionMessage,
    SyncClient,
    WatchedMessage,
    WatchOverflowed,
    connect,
)
from pie.config import BusConfig
from pie.events import inferlet as ev
from pie.server.app import Server
from pie.server.auth import UserStore
from pie.server.bus import MAX_NAME_BYTES
from pie.wire import messages as msg
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import Raw, serving
from tests.server_fixtures import connect as raw_connect

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def switchboard(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "switchboard").read_bytes()


async def test_a_watching_client_sees_each_broadcast_with_its_sender(
    tmp_path: Path, switchboard: bytes
) -> None:
    items = ["first", "second", "third"]
    async with serving(tmp_path) as server, await raw_connect(server.url) as ws:
        server.engine.programs.add(switchboard, "switchboard")
        raw = Raw(ws)
        with trio.fail_after(60):
            await raw.next()
            assert await raw.call(msg.Watch, topic="news") == msg.Done(corr=raw.corr)
            request = {"mode": "broadcast", "topic": "news", "items": items}
            launch = json.dumps(request)
            launched = await raw.call(msg.Launch, program="switchboard", input=launch)
            watched, end = [], None
            while end is None or len(watched) < len(items):
                message = await raw.next()
                if isinstance(message, msg.WatchedMessage):
                    watched.append(message)
                elif isinstance(message, msg.InferletEvent) and isinstance(
                    message.event, ev.InferletEnd
                ):
                    end = message.event
    assert isinstance(end, ev.InferletReturned) and end.result == "broadcast"
    sender = f"inferlet:{launched.instance}"
    assert watched == [msg.WatchedMessage(topic="news", sender=sender, message=m) for m in items]


async def test_an_inferlet_receives_what_a_client_publishes(
    tmp_path: Path, switchboard: bytes
) -> None:
    async with serving(tmp_path) as server, connect(server.url) as client:
        server.engine.programs.add(switchboard, "switchboard")
        with trio.fail_after(60):
            listener = await client.launch(
                "switchboard", {"mode": "listen", "topic": "orders", "count": 2}
            )
            assert await _next_text(listener) == "ready"
            async with await client.watch("orders") as watch:
                await client.publish("orders", "left")
                await client.publish("orders", "right")
                outcome = await listener.result()
                seen = [await watch.next(), await watch.next()]
    assert outcome.ok and json.loads(outcome.result or "") == ["left", "right"]
    # The watcher sees the client's own broadcasts, sent from its connection's bus address.
    assert [m.message for m in seen if m] == ["left", "right"]
    assert all(m and m.sender.startswith("session:") for m in seen)


async def test_an_inferlet_works_through_jobs_a_client_pushes(
    tmp_path: Path, switchboard: bytes
) -> None:
    async with serving(tmp_path) as server, connect(server.url) as client:
        server.engine.programs.add(switchboard, "switchboard")
        with trio.fail_after(60):
            # Pushed before any inferlet pulls: the queue keeps them.
            for job in ("wash", "dry", "stop"):
                await client.push("jobs", job)
            watch = await client.watch("done")
            worker = await client.launch(
                "switchboard", {"mode": "work", "queue": "jobs", "topic": "done"}
            )
            outcome = await worker.result()
            answers = [await watch.next(), await watch.next()]
            await watch.stop()
            assert await watch.next() is None
            stats = server.engine.statistics().bus
    assert outcome.ok and outcome.result == "2"
    assert [(m.sender, m.message) for m in answers if m] == [
        (f"inferlet:{worker.instance}", "WASH"),
        (f"inferlet:{worker.instance}", "DRY"),
    ]
    assert stats.queued_messages == 0 and stats.subscriptions == 0


async def test_bad_names_and_messages_are_refused_and_the_connection_stays(
    tmp_path: Path,
) -> None:
    long_name = "n" * (MAX_NAME_BYTES + 1)
    async with serving(tmp_path) as server, await raw_connect(server.url) as ws:
        raw = Raw(ws)
        with trio.fail_after(30):
            await raw.next()
            refusals = [
                await raw.call(msg.Watch, topic=""),
                await raw.call(msg.Publish, topic=long_name, message="x"),
                await raw.call(msg.Push, queue="tab\there", message="x"),
                await raw.call(
                    msg.Publish, topic="t", message="x" * (BusConfig().max_message_kb * 1024 + 1)
                ),
                await raw.call(msg.Unwatch, topic="never"),
            ]
            await ws.send_message('{"type": "Watch", "corr": 50, "topic": "\\ud800"}')
            surrogate = await raw.next()
            assert await raw.call(msg.Watch, topic="once") == msg.Done(corr=raw.corr)
            twice = await raw.call(msg.Watch, topic="once")
            status = await raw.call(msg.QueryStatistics)
    kinds = [failure.kind for failure in refusals]
    assert kinds == ["bad-frame", "bad-frame", "bad-frame", "too-large", "not-watching"]
    assert "empty" in refusals[0].message and str(MAX_NAME_BYTES) in refusals[1].message
    assert "control character" in refusals[2].message
    assert (surrogate.corr, surrogate.kind) == (50, "bad-frame")
    assert "Unicode" in surrogate.message
    assert twice.kind == "already-watching"
    assert isinstance(status, msg.EngineStatus)


async def test_with_auth_on_only_an_authenticated_user_watches_or_injects(
    tmp_path: Path,
) -> None:
    users = UserStore(tmp_path / "users")
    token = users.add("ada")
    async with (
        serving(tmp_path, auth="on", users=users) as server,
        await raw_connect(server.url) as ws,
    ):
        raw = Raw(ws)
        with trio.fail_after(30):
            await raw.next()
            refused = [
                await raw.call(msg.Watch, topic="news"),
                await raw.call(msg.Publish, topic="news", message="x"),
                await raw.call(msg.Push, queue="jobs", message="x"),
            ]
            assert server.engine.statistics().bus.subscriptions == 0
            await raw.call(msg.Authenticate, user="ada", token=token)
            assert await raw.call(msg.Watch, topic="news") == msg.Done(corr=raw.corr)
            await raw.call(msg.Publish, topic="news", message="hello")
            seen = await raw.next()
    assert [failure.kind for failure in refused] == ["unauthenticated"] * 3
    assert seen == msg.WatchedMessage(topic="news", sender=seen.sender, message="hello")


async def test_a_watch_ends_when_stopped_or_when_its_connection_closes(tmp_path: Path) -> None:
    async with serving(tmp_path) as server:
        bus = server.engine.statistics
        with trio.fail_after(30):
            async with await raw_connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                await raw.call(msg.Watch, topic="a")
                await raw.call(msg.Watch, topic="b")
                assert bus().bus.subscriptions == 2
                assert await raw.call(msg.Unwatch, topic="a") == msg.Done(corr=raw.corr)
                assert bus().bus.subscriptions == 1
            while bus().bus.subscriptions:
                await trio.sleep(0.01)


async def test_unread_messages_overflow_and_the_client_stops_watching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pie.client.bus.WATCH_BUFFER", 4)
    async with serving(tmp_path) as server, connect(server.url) as client:
        with trio.fail_after(30):
            watch = await client.watch("flood")
            for n in range(10):
                await client.publish("flood", str(n))
            # The client unwatches the topic on the server once the queue overflows.
            while server.engine.statistics().bus.subscriptions:
                await trio.sleep(0.01)
            read = [await watch.next() for _ in range(4)]
            with pytest.raises(WatchOverflowed) as overflowed:
                await watch.next()
            again = await client.watch("flood")
            await client.publish("flood", "after")
            after = await again.next()
    assert [m.message for m in read if m] == ["0", "1", "2", "3"]
    assert overflowed.value.topic == "flood"
    assert after is not None and after.message == "after"


async def test_a_client_cannot_watch_a_topic_twice(tmp_path: Path) -> None:
    async with serving(tmp_path) as server, connect(server.url) as client:
        with trio.fail_after(30):
            await client.watch("once")
            with pytest.raises(PieError, match="already watches"):
                await client.watch("once")
            with pytest.raises(ServerError) as refused:
                await client.publish("", "x")
    assert refused.value.kind == "bad-frame"


async def test_the_blocking_client_watches_publishes_and_pushes(tmp_path: Path) -> None:
    def use(url: str) -> list[WatchedMessage | None]:
        with SyncClient.connect(url) as client, client.watch("t") as watch:
            client.publish("t", "one")
            client.publish("t", "two")
            client.push("q", "job")
            return [watch.next(), watch.next()]

    async with serving(tmp_path) as server:
        with trio.fail_after(60):
            seen = await trio.to_thread.run_sync(use, server.url)
            stats = server.engine.statistics().bus
    assert [m.message for m in seen if m] == ["one", "two"]
    assert stats.queued_messages == 1 and stats.subscriptions == 0


async def test_the_watch_publish_and_push_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with serving(tmp_path) as server:
        bus = server.engine.statistics
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                codes: list[int] = []
                watch = cli_args(server, topics=["t1", "t2"], count=3, json=True)
                nursery.start_soon(_in_thread, client_cli.run_watch, watch, codes)
                while bus().bus.subscriptions < 2:
                    await trio.sleep(0.01)
                for topic, text in (("t1", "a"), ("t2", "b\nc"), ("t1", "d")):
                    code = await trio.to_thread.run_sync(
                        client_cli.run_publish, cli_args(server, topic=topic, message=text)
                    )
                    assert code == 0
            push = cli_args(server, queue="q", message="job")
            pushed = await trio.to_thread.run_sync(client_cli.run_push, push)
            bad = await trio.to_thread.run_sync(
                client_cli.run_publish, cli_args(server, topic="", message="x")
            )
            stats = bus().bus
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert codes == [0] and pushed == 0 and stats.queued_messages == 1
    assert sorted((line["topic"], line["message"]) for line in lines) == [
        ("t1", "a"),
        ("t1", "d"),
        ("t2", "b\nc"),
    ]
    assert all(line["sender"].startswith("session:") for line in lines)
    assert bad == 1 and "bad-frame" in err


# -- helpers ---------------------------------------------------------------------------------


async def _next_text(inferlet: Any) -> str:
    while not isinstance(event := await inferlet.next_event(), SessionMessage):
        assert event is not None, "the inferlet ended first"
    return str(event.text)


async def _in_thread(fn: Callable[[argparse.Namespace], int], args: Any, codes: list[int]) -> None:
    codes.append(await trio.to_thread.run_sync(fn, args))


def cli_args(server: Server, **fields: Any) -> argparse.Namespace:
    """What `pie watch | publish | push` parse: the connection options, then their own."""
    return argparse.Namespace(server=server.url, user=None, token=None, key=None, **fields)
