"""Every `pie` command fails in one line an operator can act on, with exit code 2 for the command
line, the config or a file it names and 1 for a failure while running; the traceback only under
`pie --debug`. `pie serve` binds its ports before it loads a model: a taken one ends it at once,
naming the port and the setting that moves it, and the bound sockets are the ones then served.
A model load from the conversion cache says so."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from pie.cli import main
from pie.cli.errors import report
from pie.client import connect
from pie.config import EngineConfig, with_overrides
from pie.drivers.loader import resolve
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import open_engine
from pie.server.app import Server
from pie.server.http import HttpFront
from pie.server.main import PortUnavailable, bind_ports
from pie.server.mounts import Mounts
from tests.server_fixtures import PYTEST_CACHE

WASM_HEADER = b"\0asm\x01\0\0\0"


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    """What the command told on stderr, checked to be a single `pie: ...` line."""
    err = capsys.readouterr().err
    assert err.startswith("pie: ") and err.count("\n") == 1, err
    return err.removeprefix("pie: ").rstrip("\n")


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port another program listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.integration
def test_a_config_file_that_is_not_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "pie.toml"
    assert main(["generate", "hi", "--config", str(missing)]) == 2
    assert one_line(capsys) == f"cannot read config {missing}: No such file or directory"


@pytest.mark.integration
def test_an_unknown_model_is_one_line_from_inside_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = tmp_path / "p.wasm"
    program.write_bytes(WASM_HEADER)
    assert main(["run", str(program), "--model", str(tmp_path / "nowhere")]) == 2
    assert one_line(capsys).startswith(f"model not found: {tmp_path / 'nowhere'} (expected")


@pytest.mark.integration
def test_a_program_file_missing_or_not_a_component(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing, text = tmp_path / "gone.wasm", tmp_path / "notes.txt"
    text.write_text("hello")
    assert main(["run", str(missing)]) == 2
    assert one_line(capsys) == f"{missing}: No such file or directory"
    assert main(["run", str(text), "--model", str(tmp_path / "nowhere")]) == 2
    assert one_line(capsys).startswith(f"{text} is not a WebAssembly component")


@pytest.mark.integration
def test_an_unreachable_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = tmp_path / "p.wasm"
    program.write_bytes(WASM_HEADER)
    url = f"ws://127.0.0.1:{closed_port()}"
    assert main(["submit", str(program), "--server", url]) == 2
    assert one_line(capsys).startswith(f"cannot reach {url}: ")


@pytest.mark.unit
def test_a_file_that_is_no_event_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing, foreign = tmp_path / "gone.jsonl", tmp_path / "other.jsonl"
    foreign.write_text('{"a": 1}\n')
    assert main(["log", str(missing)]) == 2
    assert one_line(capsys) == f"{missing}: No such file or directory"
    for command in ("log", "replay"):
        assert main([command, str(foreign)]) == 2
        assert (
            one_line(capsys)
            == f"{foreign} is not an event log: a record after 0 good ones has no 'seq'"
        )


@pytest.mark.unit
def test_debug_adds_the_traceback_before_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = tmp_path / "other.jsonl"
    foreign.write_text('{"a": 1}\n')
    assert main(["--debug", "log", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "KeyError: 'seq'" in err
    assert err.splitlines()[-1].startswith(f"pie: {foreign} is not an event log")


@pytest.mark.unit
def test_a_failure_while_running_is_exit_1_and_a_bug_is_named_as_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nested = ExceptionGroup("engine", [ExceptionGroup("driver", [RuntimeError("GPU lost\nat")])])
    assert report(nested, debug=False) == 1
    assert one_line(capsys) == "GPU lost"
    several = ExceptionGroup("engine", [RuntimeError("first"), OSError("second")])
    assert report(several, debug=False) == 1
    assert one_line(capsys) == "first (and 1 more errors)"
    assert report(KeyError("seq"), debug=False) == 1
    assert one_line(capsys) == "internal error: KeyError: 'seq' (pie --debug shows where)"


@pytest.mark.integration
def test_a_taken_port_ends_pie_serve_before_any_model_loads(tmp_path: Path) -> None:
    nowhere = str(tmp_path / "no-model")  # were it loaded first, the error would name it
    serve = [sys.executable, "-m", "pie.cli", "serve", "--model", nowhere]
    with held_port() as port:
        started = time.monotonic()
        runs = [
            subprocess.Popen([*serve, "--port", str(port)], stderr=subprocess.PIPE, text=True),
            subprocess.Popen(
                [*serve, "--port", "0", "--http", str(port)], stderr=subprocess.PIPE, text=True
            ),
        ]
        told = [run.communicate(timeout=120)[1] for run in runs]
        took = time.monotonic() - started
    taken = f"pie: port {port} on 127.0.0.1 is in use by another program: stop it, or pick another"
    assert [run.returncode for run in runs] == [2, 2]
    assert told[0] == f"{taken} port with --port or [server] port (0 picks a free one)\n"
    assert told[1] == f"{taken} port with --http or [http] port (0 picks a free one)\n"
    assert took < 30, f"took {took:.1f} s"


@pytest.mark.integration
async def test_the_sockets_bound_first_are_the_ones_served(tokenizer: Tokenizer) -> None:
    config = with_overrides(
        EngineConfig(),
        server={"host": "127.0.0.1", "port": 0},
        http={"port": 0},
        sandbox={"cache_dir": str(PYTEST_CACHE / "pie-components")},
    )
    ports = bind_ports(config)
    ws_port, http_port = (s[0].getsockname()[1] for s in (ports.websocket, ports.http))
    again = with_overrides(config, server={"port": ws_port}, http={"port": -1})
    with pytest.raises(PortUnavailable, match=rf"^port {ws_port} on 127\.0\.0\.1 is in use"):
        bind_ports(again)
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        server = Server(engine, config.server, sockets=ports.websocket)
        front = HttpFront(engine, config.http, Mounts({}), host="127.0.0.1", sockets=ports.http)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            await nursery.start(front.run)
            with trio.fail_after(30):
                async with httpx.AsyncClient() as http:
                    missing = await http.get(f"http://127.0.0.1:{http_port}/nothing")
                async with connect(f"ws://127.0.0.1:{ws_port}") as client:
                    status = await client.statistics()
            front.stop()
            await server.stop(grace=1)
            nursery.cancel_scope.cancel()
    ports.close()
    assert (server.port, front.port) == (ws_port, http_port)
    assert missing.status_code == 404 and missing.json()["error"] == {
        "message": "nothing is mounted at /nothing",
        "type": "not_found_error",
        "param": None,
        "code": "not_found",
    }
    assert status.models


@pytest.mark.unit
def test_a_model_from_the_conversion_cache_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(
        resolve, "convert_gguf", lambda _, out: (out / "config.json").write_text("{}")
    )
    first = resolve.converted_gguf(gguf, tmp_path / "cache")
    assert capsys.readouterr().err.startswith(f"pie: converting {gguf} (first use")
    again = resolve.converted_gguf(gguf, tmp_path / "cache")
    assert again == first
    assert capsys.readouterr().err == f"pie: using the cached conversion of tiny.gguf at {first}\n"
