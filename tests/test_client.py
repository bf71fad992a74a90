"""The Python client and the client commands against a live server on the synthetic driver:
installs that upload once, launches streamed to their outcome, messages both ways, terminate,
re-attaching after a lost connection, errors by kind, the blocking client and `pie submit`."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.cli import client as client_cli
from pie.cli.parser import add_client_parsers
from pie.client import (
    CannotConnect,
    ConnectionLost,
    EventsOverflowed,
    InferletReturned,
    InferletStarted,
    NoSuchInferlet,
    NoSuchProgram,
    NotOwner,
    ServerError,
    SessionMessage,
    SyncClient,
    connect,
)
from pie.server.app import Server
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import serving

pytestmark = pytest.mark.integration

RELAY = {"mode": "relay"}  # answers each message "n:text" until "bye"


@pytest.fixture(scope="module")
def relay(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "relay").read_bytes()


def count(n: int) -> dict[str, Any]:
    return {"mode": "count", "n": n}  # sends "0" .. "n-1", returns "counted"


async def test_install_uploads_once_and_reports_progress(tmp_path: Path, relay: bytes) -> None:
    seen: list[tuple[int, int]] = []
    async with serving(tmp_path) as server, connect(server.url) as client:
        with trio.fail_after(120):
            assert client.welcome is not None and not client.welcome.auth_required
            info = await client.install(relay, name="relay", version="1.0", progress=_add(seen))
            assert info.hash == hashlib.sha256(relay).hexdigest() and info.size == len(relay)
            assert seen[-1] == (len(relay), len(relay))
            assert [sent for sent, _ in seen] == sorted(sent for sent, _ in seen)
            again: list[tuple[int, int]] = []
            assert await client.install(relay, name="relay", version="1.0", progress=_add(again))
            assert await client.install(relay, progress=_add(again)) == info
            assert again == []
            assert await client.query_program("relay@1.0") == info
            assert await client.query_program("nothing-here") is None


async def test_a_launch_streams_typed_events_to_its_outcome(tmp_path: Path, relay: bytes) -> None:
    async with serving(tmp_path) as server, connect(server.url) as client:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            inferlet = await client.launch("relay", count(3))
            events = [event async for event in inferlet.events()]
            outcome = await inferlet.result()
    assert isinstance(events[0], InferletStarted)
    assert [e.text for e in events if isinstance(e, SessionMessage)] == ["0", "1", "2"]
    assert isinstance(events[-1], InferletReturned) and inferlet.last_seq == 5
    assert outcome.ok and (outcome.result or "").strip('"') == "counted"


async def test_messages_go_both_ways_and_terminate_ends_the_inferlet(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path) as server, connect(server.url) as client:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            inferlet = await client.launch("relay", RELAY)
            for text in ["a", "b"]:
                await inferlet.send(text)
                assert await _next_message(inferlet) == f"{['a', 'b'].index(text) + 1}:{text}"
            await inferlet.terminate()
            outcome = await inferlet.result()
    assert outcome.status == "terminated" and not outcome.ok


async def test_a_reattach_after_a_lost_connection_replays_from_last_seq(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with connect(server.url) as client:
                first = await client.launch("relay", RELAY)
                await first.send("a")
                assert await _next_message(first) == "1:a"
            with pytest.raises(ConnectionLost):
                await first.next_event()
            async with connect(server.url) as client:
                again = await client.attach(first.instance, after=first.last_seq)
                await again.send("b")
                await again.send("bye")
                events = [event async for event in again.events()]
                assert again.last_seq == first.last_seq + 2
    assert [e.text for e in events if isinstance(e, SessionMessage)] == ["2:b"]
    assert again.outcome is not None and again.outcome.result == "2"


async def test_unread_events_overflow_into_an_error_and_a_reattach_resumes(
    tmp_path: Path, relay: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pie.client.inferlet.EVENT_BUFFER", 3)
    async with serving(tmp_path) as server, connect(server.url) as client:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            inferlet = await client.launch("relay", count(10))
            while server.hub.live_instances():
                await trio.sleep(0.01)
            await client.statistics()  # replies follow the events sent before them
            with pytest.raises(EventsOverflowed, match="after=3"):
                while await inferlet.next_event() is not None:
                    pass
            assert inferlet.last_seq == 3 and inferlet.outcome is None
            monkeypatch.undo()
            again = await client.attach(inferlet.instance, after=inferlet.last_seq)
            events = [event async for event in again.events()]
    assert [e.text for e in events if isinstance(e, SessionMessage)] == [
        str(n) for n in range(2, 10)
    ]
    assert again.outcome is not None and again.outcome.ok


async def test_list_and_statistics_show_a_running_inferlet(tmp_path: Path, relay: bytes) -> None:
    async with serving(tmp_path) as server, connect(server.url) as client:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            inferlet = await client.launch("relay", RELAY)
            listed = await client.list()
            stats = await client.statistics()
            await inferlet.terminate()
            await inferlet.result()
    assert [(i.instance, i.attached) for i in listed] == [(inferlet.instance, True)]
    assert listed[0].program.startswith("relay")
    assert stats.pages_free > 0 and stats.inferlets_running + stats.inferlets_queued == 1


async def test_failures_raise_by_kind_and_other_users_are_not_owners(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with connect(server.url, user="alice") as alice:
                with pytest.raises(NoSuchProgram) as missing:
                    await alice.launch("nothing-here")
                assert missing.value.kind == "no-such-program"
                with pytest.raises(NoSuchInferlet):
                    await alice.attach("i999")
                inferlet = await alice.launch("relay", RELAY)
                async with connect(server.url, user="bob") as bob:
                    assert bob.user == "bob" and await bob.list() == []
                    with pytest.raises(NotOwner):
                        await bob.terminate(inferlet.instance)
                    with pytest.raises(ServerError, match="not-owner"):
                        await bob.attach(inferlet.instance)
                await inferlet.send("bye")
                assert (await inferlet.result()).result == "0"


async def test_an_unreachable_server_raises_cannot_connect() -> None:
    with pytest.raises(CannotConnect) as failed:
        async with connect(f"ws://127.0.0.1:{_free_port()}"):
            pass
    assert failed.value.url.startswith("ws://127.0.0.1:")


async def test_the_blocking_client_launches_and_waits(tmp_path: Path, relay: bytes) -> None:
    def use(url: str) -> tuple[list[Any], Any]:
        with SyncClient.connect(url) as client:
            inferlet = client.launch("relay", RELAY)
            inferlet.send("hello")
            inferlet.send("bye")
            events = list(inferlet.events())
            return events, inferlet.result()

    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            events, outcome = await trio.to_thread.run_sync(use, server.url)
    assert [e.text for e in events if isinstance(e, SessionMessage)] == ["1:hello"]
    assert outcome.ok and outcome.result == "1"


def test_submit_uploads_streams_and_prints_the_result_last(
    tmp_path: Path, relay: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    wasm = tmp_path / "relay.wasm"
    wasm.write_bytes(relay)
    with background_server(tmp_path) as server:
        code = client_cli.run_submit(
            cli_args("submit", str(wasm), "--input", json.dumps(count(3)), server=server)
        )
        out, err = capsys.readouterr()
        assert code == 0 and out.startswith("012\n") and out.strip('"\n').endswith("counted")
        assert "upload" in err
        code = client_cli.run_submit(
            cli_args("submit", str(wasm), "--input", '{"mode": "?"}', server=server)
        )
        out, err = capsys.readouterr()
        assert code == 1 and out == "" and "upload" not in err and "unknown mode" in err
        code = client_cli.run_submit(
            cli_args("submit", str(wasm), "--input", json.dumps(RELAY), "--detach", server=server)
        )
        instance = capsys.readouterr().out.strip()
        assert code == 0 and instance
        assert client_cli.run_list(cli_args("list", server=server)) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split() == ["INSTANCE", "PROGRAM", "STATE", "ATTACHED"]
        assert table[1].split()[:2] == [instance, "relay@0.1.0"]
        assert client_cli.run_stop(cli_args("stop", instance, server=server)) == 0
        assert client_cli.run_attach(cli_args("attach", instance, server=server)) == 1
        assert "terminated" in capsys.readouterr().err
        assert client_cli.run_status(cli_args("status", server=server)) == 0
        figures, models = capsys.readouterr().out.split("\n\n")
        rows = dict(line.split(maxsplit=1) for line in figures.splitlines())
        assert [line.split()[:3] for line in models.splitlines()] == [
            ["model", "reads", "produces"],
            [server.engine.info.model_name, "text", "text"],
        ]
        assert int(rows["pages_free"]) > 0
        assert int(rows["driver_threads"]) == server.engine.info.threads
        parts = ("model", "kv_used", "other")
        resident = sum(float(rows[f"memory_{part}_mb"]) for part in parts)
        assert float(rows["memory_resident_mb"]) == pytest.approx(resident, abs=0.1)
        assert resident > 0


def with_custom_section(wasm: bytes, payload: bytes) -> bytes:
    """The same component with a custom section appended: other bytes, the same program."""
    name = b"pie-test"
    body = bytes([len(name)]) + name + payload
    assert len(body) < 128  # one LEB128 byte for its size
    return wasm + bytes([0, len(body)]) + body


def test_submit_of_a_new_build_under_a_taken_default_name_runs_it_by_hash(
    tmp_path: Path, relay: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    wasm = tmp_path / "relay.wasm"
    with background_server(tmp_path) as server:
        for build in (relay, with_custom_section(relay, b"second build")):
            wasm.write_bytes(build)
            code = client_cli.run_submit(
                cli_args("submit", str(wasm), "--input", json.dumps(count(2)), server=server)
            )
            out, err = capsys.readouterr()
            assert code == 0 and out.startswith("01\n")
        assert "relay@0.1.0 is another build; running this one by its hash" in err
        # Asked for by name@version, a taken name is refused.
        code = client_cli.run_submit(
            cli_args("submit", str(wasm), "--version", "0.1.0", server=server)
        )
        assert code != 0 and "name-taken" in capsys.readouterr().err


def test_ctrl_c_while_streaming_detaches_and_leaves_it_running(
    tmp_path: Path, relay: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    wasm = tmp_path / "relay.wasm"
    wasm.write_bytes(relay)
    with background_server(tmp_path) as server:
        interrupt = threading.Thread(target=_interrupt_once_live, args=(server,), daemon=True)
        interrupt.start()
        code = client_cli.run_submit(
            cli_args("submit", str(wasm), "--input", json.dumps(RELAY), server=server)
        )
        interrupt.join()
        err = capsys.readouterr().err
        assert code == 130 and "pie attach" in err
        assert len(server.hub.live_instances()) == 1
        hint = err.split("pie attach ")[1].split()
        assert hint[0] == server.hub.live_instances()[0] and hint[1:3] == ["--after", "1"]
        assert client_cli.run_stop(cli_args("stop", hint[0], server=server)) == 0


def test_an_unreachable_server_is_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"ws://127.0.0.1:{_free_port()}"
    assert client_cli.run_status(cli_args("status", "--server", url)) == 2
    assert capsys.readouterr().err.startswith(f"pie: cannot reach {url}: ")
    with pytest.raises(CannotConnect):
        SyncClient.connect(url)


# -- helpers ---------------------------------------------------------------------------------


def _add(seen: list[tuple[int, int]]) -> Callable[[int, int], None]:
    return lambda sent, total: seen.append((sent, total))


async def _next_message(inferlet: Any) -> str:
    while not isinstance(event := await inferlet.next_event(), SessionMessage):
        assert event is not None, "the inferlet ended first"
    return str(event.text)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cli_args(*argv: str, server: Server | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pie")
    add_client_parsers(parser.add_subparsers(dest="command"))
    extra = ["--server", server.url] if server is not None else []
    return parser.parse_args([*argv, *extra])


@contextmanager
def background_server(tmp_path: Path) -> Iterator[Server]:
    """A server on its own Trio loop in a thread, for the commands that run `trio.run`."""
    ready: list[Any] = []
    started = threading.Event()

    async def main() -> None:
        async with serving(tmp_path) as server:
            stop = trio.Event()
            ready.extend([server, stop, trio.lowlevel.current_trio_token()])
            started.set()
            await stop.wait()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(120), "the server did not start"
    server, stop, token = ready
    try:
        yield server
    finally:
        token.run_sync_soon(stop.set)
        thread.join(60)


def _interrupt_once_live(server: Server) -> None:
    """Sends this process Ctrl-C once an inferlet has been streaming for a moment."""
    for _ in range(6000):
        if server.hub.live_instances():
            break
        threading.Event().wait(0.01)
    threading.Event().wait(1.0)
    os.kill(os.getpid(), signal.SIGINT)
