"""MCP tools from an inferlet, against a real MCP server (tests/mcp_server.py) over stdio and
streamable HTTP: listing and calling, the failure kinds, a server that cannot start or crashes
(the engine serves on), per-user servers, the servers stopped with the engine, and the config."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import mcp_types
import pytest
import trio

from pie.actors.mcp import McpStatistics
from pie.actors.mcp.results import McpFailure, called_event, parse_arguments, render
from pie.config import ConfigError, config_from_dict
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import Engine, open_engine
from tests.guests.fake_host import FakeHost, run_guest
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

SERVER = str(Path(__file__).with_name("mcp_server.py"))
TOOLS = ("add", "echo", "fail", "refuse", "sleep", "hold", "release", "crash", "env", "header")


@pytest.fixture(scope="module")
def toolbox_wasm(built: Callable[[Path], Path]) -> Path:  # noqa: F811
    return built(GUESTS / "toolbox")


@pytest.fixture(scope="module")
def toolbox(toolbox_wasm: Path) -> bytes:
    return toolbox_wasm.read_bytes()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One component cache for the module, so the toolbox is compiled once."""
    return tmp_path_factory.mktemp("components")


def stdio(name: str = "tools", **extra: Any) -> dict[str, Any]:
    return {"name": name, "command": [sys.executable, SERVER], **extra}


def call(tool: str, server: str = "tools", **step: Any) -> dict[str, Any]:
    return {"op": "call", "server": server, "tool": tool, **step}


class Toolbox:
    """An engine with MCP servers configured and the toolbox guest loaded."""

    def __init__(self, engine: Engine, program: str) -> None:
        self.engine = engine
        self.program = program

    async def run(self, *steps: dict[str, Any], user: str = "local") -> list[Any]:
        payload = json.dumps({"steps": list(steps)})
        outcome = await self.engine.run_inferlet(self.program, payload, user=user)
        assert outcome.ok, outcome.error
        return json.loads(outcome.result)

    def statistics(self) -> McpStatistics:
        return self.engine.statistics().mcp


@contextlib.asynccontextmanager
async def open_toolbox(
    tokenizer: Tokenizer, wasm: bytes, cache_dir: Path, servers: list[dict[str, Any]], **mcp: Any
) -> AsyncIterator[Toolbox]:
    config = config_from_dict(
        {"sandbox": {"cache_dir": str(cache_dir)}, "mcp": {"servers": servers, **mcp}}
    )
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        yield Toolbox(engine, engine.programs.add(wasm, name="toolbox").hash)


@pytest.mark.integration
async def test_an_inferlet_lists_the_tools_and_calls_them(
    toolbox: bytes, tokenizer: Tokenizer, cache_dir: Path
) -> None:
    with trio.fail_after(120):
        async with open_toolbox(
            tokenizer, toolbox, cache_dir, [stdio(env={"PIE_TEST": "from the config"})]
        ) as box:
            servers, tools, added, echoed, env, failed = await box.run(
                {"op": "servers"},
                {"op": "tools", "server": "tools"},
                call("add", arguments={"a": 2, "b": 40}),
                call("echo", arguments={"text": "héllo\nworld"}),
                call("env", arguments={"name": "PIE_TEST"}),
                call("fail", arguments={"reason": "the disk is on fire"}),
            )
            stats = box.statistics()
    assert servers == ["tools"]
    assert [tool["name"] for tool in tools] == list(TOOLS)
    add = tools[0]
    assert add["description"] == "Adds two integers."
    assert add["schema"]["required"] == ["a", "b"]
    assert add["schema"]["properties"]["a"]["type"] == "integer"
    assert added == {
        "text": "42",
        "content": [{"type": "text", "text": "42"}],
        "structured": {"result": 42},
        "is_error": False,
    }
    assert echoed["text"] == "héllo\nworld" and not echoed["is_error"]
    assert env["text"] == "from the config"
    assert failed["is_error"] and "the disk is on fire" in failed["text"]
    (server,) = stats.servers
    assert (server.starts, server.listings, server.calls, server.tool_errors) == (1, 1, 4, 1)
    assert stats.running == 0 and stats.failures == 0 and server.connected


@pytest.mark.integration
async def test_failures_come_back_as_error_kinds(
    toolbox: bytes, tokenizer: Tokenizer, cache_dir: Path
) -> None:
    with trio.fail_after(120):
        async with open_toolbox(
            tokenizer, toolbox, cache_dir, [stdio()], max_result_mb=0.01
        ) as box:
            got = await box.run(
                call("echo", server="nowhere", arguments={"text": "x"}),
                {"op": "tools", "server": "nowhere"},
                call("no_such_tool"),
                call("refuse"),
                {"op": "raw", "server": "tools", "tool": "echo", "text": "[1, 2]"},
                {"op": "raw", "server": "tools", "tool": "echo", "text": "{not json"},
                call("sleep", arguments={"seconds": 30}, timeout=0.5),
                call("echo", arguments={"text": "x" * 20_000}),
                call("echo", arguments={"text": "still here"}),
            )
            stats = box.statistics()
    kinds = [result.get("error") for result in got]
    assert kinds == [
        "no-such-server",
        "no-such-server",
        "no-such-tool",
        "tool-failed",
        "invalid",
        "invalid",
        "timeout",
        "too-large",
        None,
    ]
    assert "'nowhere'" in got[0]["message"] and "'tools'" in got[0]["message"]
    assert "refused on purpose" in got[3]["message"]
    assert got[8]["text"] == "still here"
    assert stats.failures == 8 and stats.servers[0].starts == 1


@pytest.mark.integration
async def test_a_server_that_cannot_start_is_unavailable_and_the_engine_serves_on(
    toolbox: bytes, tokenizer: Tokenizer, cache_dir: Path, tmp_path: Path
) -> None:
    servers = [
        {"name": "missing", "command": [str(tmp_path / "no-such-program")]},
        {"name": "quits", "command": [sys.executable, "-c", "raise SystemExit(2)"]},
        {"name": "down", "url": f"http://user:secret@127.0.0.1:{_free_port()}/mcp?key=secret"},
        stdio(),
    ]
    with trio.fail_after(120):
        async with open_toolbox(tokenizer, toolbox, cache_dir, servers, retry_seconds=600) as box:
            first = await box.run(
                {"op": "tools", "server": "missing"},
                {"op": "tools", "server": "missing"},
                call("echo", server="quits", arguments={"text": "x"}),
                {"op": "tools", "server": "down"},
                call("echo", arguments={"text": "fine"}),
            )
            second = await box.run(call("add", arguments={"a": 1, "b": 1}))
            stats = {s.name: s for s in box.statistics().servers}
    missing, again, quits, down, fine = first
    assert missing["error"] == "unavailable" and "no-such-program" in missing["message"]
    assert again["error"] == "unavailable" and "next try" in again["message"]
    assert quits["error"] == "unavailable" and "'quits'" in quits["message"]
    assert down["error"] == "unavailable" and "was not reached" in down["message"]
    assert "secret" not in down["message"]
    assert fine["text"] == "fine" and second[0]["text"] == "2"
    assert stats["missing"].start_failures == 1 and stats["missing"].starts == 0
    assert stats["quits"].start_failures == 1 and stats["tools"].starts == 1


@pytest.mark.integration
async def test_a_server_that_never_answers_gives_up_after_connect_seconds(
    toolbox: bytes, tokenizer: Tokenizer, cache_dir: Path
) -> None:
    silent = {"name": "silent", "command": [sys.executable, "-c", "import time; time.sleep(60)"]}
    with trio.fail_after(120):
        async with open_toolbox(tokenizer, toolbox, cache_dir, [silent], connect_seconds=1) as box:
            (got,) = await box.run({"op": "tools", "server": "silent"})
            stats = box.statistics().servers[0]
    assert got["error"] == "unavailable" and "no answer within 1 s" in got["message"]
    assert stats.start_failures == 1


@pytest.mark.integration
async def test_a_crashed_server_is_started_again_on_next_use(
    toolbox: bytes, tokenizer: Tokenizer, cache_dir: Path
) -> None:
    with trio.fail_after(120):
        async with open_toolbox(tokenizer, toolbox, cache_dir, [stdio()]) as box:
            crashed, after = await box.run(call("crash"), call("echo", arguments={"text": "back"}))
            stats = box.statistics().servers[0]
    assert crashed["error"] == "unavailable" and "broke" in crashed["message"]
    assert after["text"] == "back"
    assert stats.starts == 2 and stats.start_failures == 0


@pytest.mark.integration
async def test_a_server_can_be_kept_to_some_users(
    toolbox: bytes, tokenizer: Tokenizer, cache_dir: Path
) -> None:
    servers = [stdio("private", users=["ann"]), stdio("shared")]
    with trio.fail_after(120):
        async with open_toolbox(tokenizer, toolbox, cache_dir, servers) as box:
            bob = await box.run(
                {"op": "servers"},
                call("echo", server="private", arguments={"text": "x"}),
                user="bob",
            )
            ann = await box.run(
                {"op": "servers"},
                call("echo", server="private", arguments={"text": "hi"}),
                user="ann",
            )
            private = box.statistics().servers[0]
    assert bob[0] == ["shared"]
    assert bob[1]["error"] == "denied" and "'bob'" in bob[1]["message"]
    assert ann[0] == ["private", "shared"] and ann[1]["text"] == "hi"
    assert private.starts == 1


@pytest.mark.integration
async def test_calls_run_side_by_side(
    toolbox: bytes, tokenizer: Tokenizer, cache_dir: Path
) -> None:
    # `hold` answers only after `release` has run: were calls run one at a time, it would
    # wait for ever (and fail `timeout`).
    race = {"op": "race", "calls": [call("hold"), call("release")]}
    with trio.fail_after(120):
        async with open_toolbox(tokenizer, toolbox, cache_dir, [stdio()]) as box:
            (finished,) = await box.run(race)
    results = {entry["tool"]: entry["result"]["text"] for entry in finished}
    assert results == {"hold": "released", "release": "done"}


@pytest.mark.integration
async def test_stopping_the_engine_stops_its_servers(
    toolbox: bytes, tokenizer: Tokenizer, cache_dir: Path, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    servers = [
        stdio("one", env={"MCP_TEST_PID_FILE": str(pids)}),
        stdio("two", env={"MCP_TEST_PID_FILE": str(pids)}),
    ]
    with trio.fail_after(120):
        async with open_toolbox(tokenizer, toolbox, cache_dir, servers) as box:
            await box.run(
                call("echo", server="one", arguments={"text": "a"}),
                call("echo", server="two", arguments={"text": "b"}),
            )
            started = [int(line) for line in pids.read_text().split()]
            assert len(started) == 2 and all(_alive(pid) for pid in started)
    assert not any(_alive(pid) for pid in started)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def http_server() -> Iterator[str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, SERVER, "--http", str(port)], stderr=subprocess.DEVNULL
    )
    try:
        _wait_for_port(port, process)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the MCP test server did not start listening")


@pytest.mark.integration
async def test_a_server_over_streamable_http_gets_the_configured_headers(
    http_server: str, toolbox: bytes, tokenizer: Tokenizer, cache_dir: Path
) -> None:
    servers = [{"name": "remote", "url": http_server, "headers": {"X-Api-Key": "k-123"}}]
    with trio.fail_after(120):
        async with open_toolbox(tokenizer, toolbox, cache_dir, servers) as box:
            tools, header, added = await box.run(
                {"op": "tools", "server": "remote"},
                call("header", server="remote", arguments={"name": "x-api-key"}),
                call("add", server="remote", arguments={"a": 3, "b": 4}),
            )
    assert [tool["name"] for tool in tools] == list(TOOLS)
    assert header["text"] == "k-123" and added["structured"] == {"result": 7}


@pytest.mark.integration
def test_the_sdk_reads_what_the_host_gives(toolbox_wasm: Path, tmp_path: Path) -> None:
    steps = [
        {"op": "servers"},
        {"op": "tools", "server": "toys"},
        call("echo", server="toys", arguments={"text": "ü"}),
        call("other", server="toys"),
        {"op": "tools", "server": "elsewhere"},
    ]
    host = FakeHost()
    tag, value = run_guest(toolbox_wasm, json.dumps({"steps": steps}), host, tmp_path)
    assert tag == "ok", value
    servers, tools, echoed, other, missing = json.loads(value)
    assert servers == ["toys"]
    assert tools == [{"name": "echo", "description": "Echoes.", "schema": {"type": "object"}}]
    assert json.loads(echoed["text"]) == {"text": "ü"} and not echoed["is_error"]
    assert echoed["content"] == [{"type": "text", "text": echoed["text"]}]
    assert echoed["structured"] is None and other["is_error"]
    assert missing["error"] == "no-such-server"
    assert host.calls["mcp.call-tool"] == host.calls["mcp.called"] == 2


@pytest.mark.unit
def test_content_blocks_read_as_text() -> None:
    result = mcp_types.CallToolResult(
        content=[
            mcp_types.TextContent(text="one"),
            mcp_types.ImageContent(data="aGk=", mime_type="image/png"),
            mcp_types.EmbeddedResource(
                resource=mcp_types.TextResourceContents(uri="file:///a.txt", text="two")
            ),
            mcp_types.EmbeddedResource(
                resource=mcp_types.BlobResourceContents(uri="file:///b.bin", blob="AA==")
            ),
            mcp_types.ResourceLink(uri="file:///c.txt", name="c"),
        ],
        is_error=False,
    )
    called = called_event(9, result, 1 << 20)
    assert (
        called.text
        == "one\n[image: image/png]\ntwo\n[resource: file:///b.bin]\n[resource: file:///c.txt]"
    )
    blocks = json.loads(called.content)
    assert blocks[1] == {"type": "image", "data": "aGk=", "mimeType": "image/png"}
    assert called.structured is None and render(result.content[0]) == "one"
    with pytest.raises(McpFailure) as too_large:
        called_event(9, result, 100)
    assert too_large.value.kind == "too-large"


@pytest.mark.unit
def test_arguments_must_be_a_json_object() -> None:
    assert parse_arguments("") == {} and parse_arguments('{"a": [1]}') == {"a": [1]}
    for text in ("[1]", "3", "{oops"):
        with pytest.raises(McpFailure) as bad:
            parse_arguments(text)
        assert bad.value.kind == "invalid"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("mcp", "message"),
    [
        ({"servers": [{"name": "a"}]}, "needs one of command and url"),
        ({"servers": [{"name": "a", "command": ["x"], "url": "http://h/"}]}, "needs one of"),
        ({"servers": [{"name": "a", "command": "x --flag"}]}, "command is a list"),
        ({"servers": [{"name": "a b", "command": ["x"]}]}, "mcp server name"),
        ({"servers": [{"name": "a", "url": "ftp://h/"}]}, "http or https"),
        ({"servers": [{"name": "a", "url": "http://h/", "env": {"K": "v"}}]}, "go with command"),
        ({"servers": [{"name": "a", "command": ["x"], "headers": {"K": "v"}}]}, "go with url"),
        ({"servers": [stdio("a"), stdio("a")]}, "used twice"),
        ({"servers": [{"name": "a", "command": ["x"], "port": 1}]}, "port"),
        ({"timeout_seconds": 0}, "timeout_seconds must be > 0"),
    ],
)
def test_bad_mcp_config_is_refused_saying_why(mcp: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match="mcp") as refused:
        config_from_dict({"mcp": mcp})
    assert message in str(refused.value)


@pytest.mark.unit
def test_mcp_is_off_by_default_and_reads_from_toml_shaped_data() -> None:
    assert config_from_dict({}).mcp.servers == ()
    config = config_from_dict(
        {"mcp": {"servers": [stdio("files", cwd="/srv", users=["ann"])], "timeout_seconds": 5}}
    )
    (server,) = config.mcp.servers
    assert server.command == (sys.executable, SERVER) and server.users == ("ann",)
    assert config.mcp.timeout_seconds == 5.0
