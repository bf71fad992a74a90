"""`pie cluster up` as an operator runs it (the real command, a real `redis-server`, two real
`pie serve` nodes on the default model and the real SGLang router), started once for the module:
it prints every URL and the nodes join; what Redis acknowledged (a user, an installed program)
survives Redis being killed and started again, and a node's stale cache never serves a program
to a user who does not own it; a node stopped with SIGTERM leaves the cluster at once, finishes
its running inferlet, and is dropped by the router; Ctrl-C stops every part and leaves no
process; `pie bench cluster` runs on its nodes with tiny settings. Cheaper: a node that fails at
start ends the command in one line naming it; node configs written back as TOML read the same.
On the same nodes: a launch naming a snapshot placed on its holder, and `scenarios/swarm` with
its agents split over the two nodes."""

from __future__ import annotations

import fcntl
import json
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import psutil
import pytest
import trio
import wasmtime

from pie.cli import main
from pie.client import connect
from pie.client.errors import NoSuchProgram
from pie.cluster.local import node_config, to_toml
from pie.cluster.redis_process import free_port
from pie.server.placing import node_of
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.server_fixtures import PYTEST_CACHE
from tests.test_scenarios import cache_folder, load_scenario

GUEST = (Path(__file__).parent / "wat_guests" / "host_calls.wat").read_text()
"""Input "e…" returns it unchanged."""
LEAVE_SECONDS = 3.0
"""A node that stops cleanly is gone from `pie cluster status` this soon; its record's expiry
(ttl_seconds, 60 here) could not explain that."""


@attrs.define
class Up:
    """The running `pie cluster up`: its process, the URLs it printed and its stderr file."""

    process: subprocess.Popen[str]
    urls: dict[str, object]
    stderr: Path
    state: Path

    @property
    def redis(self) -> str:
        return str(self.urls["redis"])

    def node(self, node_id: str) -> dict[str, str]:
        nodes = self.urls["nodes"]
        assert isinstance(nodes, list)
        return next(n for n in nodes if n["node_id"] == node_id)

    def said(self) -> str:
        return self.stderr.read_text()

    def child(self, word: str) -> psutil.Process:
        """The one live descendant whose command line has `word`."""
        found = [
            p
            for p in psutil.Process(self.process.pid).children(recursive=True)
            if word in " ".join(p.cmdline())
        ]
        assert len(found) == 1, found
        return found[0]


def pie(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pie.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def status(url: str) -> dict[str, object]:
    shown = pie("cluster", "status", "--cluster", url, "--json")
    assert shown.returncode == 0, shown.stderr
    document: dict[str, object] = json.loads(shown.stdout)
    return document


def node_ids(url: str) -> list[str]:
    nodes = status(url)["nodes"]
    assert isinstance(nodes, list)
    return sorted(n["node_id"] for n in nodes)


def wait_for(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.2)


def leftovers(state: Path) -> list[psutil.Process]:
    """Live processes of the cluster whose state is in `state`: nodes name their config there,
    and Redis works in its folder there."""

    def ours(process: psutil.Process) -> bool:
        try:
            return str(state) in " ".join(process.cmdline()) or process.cwd().startswith(str(state))
        except psutil.Error:
            return False

    return [p for p in psutil.process_iter() if ours(p)]


def redis_cli(url: str, *command: str) -> str:
    port = url.rsplit(":", 1)[1].split("/")[0]
    done = subprocess.run(
        ["redis-cli", "-p", port, *command], capture_output=True, text=True, timeout=10
    )
    return done.stdout


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Up]:
    folder = tmp_path_factory.mktemp("cluster-up")
    config = folder / "pie.toml"
    config.write_text(
        f'[kv]\nnum_pages = 256\n[sandbox]\ncache_dir = "{PYTEST_CACHE / "pie-components"}"\n'
        "[cluster]\nttl_seconds = 60.0\n"
    )
    stderr = folder / "stderr.txt"
    command = [sys.executable, "-m", "pie.cli", "cluster", "up", "--nodes", "2"]
    command += ["--router-port", "0", "--state-dir", str(folder / "state")]
    command += ["--config", str(config), "--model", str(default_model_dir), "--json"]
    with stderr.open("w") as errors:
        # Ctrl-C reaches it as from a terminal even when the tests run in a background job,
        # whose shell starts every child with SIGINT ignored.
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the URLs, once every part is up
        assert line, stderr.read_text()
        yield Up(process, json.loads(line), stderr, folder / "state")
    finally:
        if process.poll() is None:  # a failed test: leave nothing behind either
            for child in [*psutil.Process(process.pid).children(recursive=True)]:
                child.kill()
            process.kill()
        process.wait()


def program() -> bytes:
    return bytes(wasmtime.wat2wasm(GUEST))


async def launch(url: str, user: str, name: str, text: str) -> str:
    async with connect(url, user=user) as client:
        inferlet = await client.launch(name, text)
        with trio.fail_after(60):
            outcome = await inferlet.result()
    assert outcome.ok, outcome
    return str(outcome.result)


@pytest.mark.model
def test_cluster_up_prints_every_url_and_serves_through_the_router(up: Up) -> None:
    assert re.fullmatch(r"redis://127\.0\.0\.1:\d+/0", up.redis)
    assert node_ids(up.redis) == ["node-1", "node-2"]
    listed = {n["node_id"]: n for n in status(up.redis)["nodes"]}  # type: ignore[union-attr]
    for node_id in ("node-1", "node-2"):
        printed = up.node(node_id)
        assert listed[node_id]["ws_url"] == printed["ws_url"]
        assert listed[node_id]["http_url"] == printed["http_url"]
    router = str(up.urls["router"])
    assert up.urls["policy"] == "cache_aware" and router.endswith("/v1")
    models = httpx.get(f"{router}/models", timeout=30).json()["data"]
    reply = httpx.post(
        f"{router}/chat/completions",
        json={
            "model": models[0]["id"],
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def relay(built: Any) -> bytes:  # noqa: F811
    """Saves a text under a name, or opens a name and answers its token count or the error."""
    return built(GUESTS / "relay").read_bytes()


async def finished(inferlet: Any) -> Any:
    with trio.fail_after(120):
        outcome = await inferlet.result()
    assert outcome.ok, outcome
    return outcome.result


@pytest.mark.model
async def test_a_launch_naming_a_snapshot_runs_on_the_node_that_saved_it(
    up: Up, relay: bytes
) -> None:
    urls = {n: up.node(n)["ws_url"] for n in ("node-1", "node-2")}
    async with connect(urls["node-1"], user="cy") as client:
        await client.install(relay, name="relay", version="1.0")
        saving = {"mode": "save", "name": "notes", "text": "the plan, " * 6}
        saver = await client.launch("relay", json.dumps(saving))
        saved = await finished(saver)
    holder = node_of(saver.instance)
    listed: Any = status(up.redis)["snapshots"]
    assert holder in urls and [(e["name"], e["node"]) for e in listed] == [("notes", holder)]
    (elsewhere,) = (url for node, url in urls.items() if node != holder)
    async with connect(elsewhere, user="cy") as client:
        opening = json.dumps({"mode": "open", "name": "notes"})
        opener = await client.launch("relay", opening, snapshots=["notes"])
        opened = await finished(opener)
    assert node_of(opener.instance) == holder, "placed on the node holding the snapshot"
    assert int(opened) == int(saved) > 4, "it opened every token the save kept"


@pytest.mark.model
def test_the_swarm_runs_with_its_agents_split_over_the_two_nodes(
    up: Up, pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """scenarios/swarm: the coordinator, planner and editor on node-1, the writers and the
    critic on node-2, cooperating over the cluster's bus, a client on node-1 watching it all."""
    inferlets = cache_folder(pytestconfig, tmp_path_factory, "pie-inferlets")
    one, two = (up.node(n)["ws_url"] for n in ("node-1", "node-2"))
    report = load_scenario("swarm").run(one, cache_dir=inferlets, elsewhere=two)
    assert all(report["checks"].values()), (report["checks"], report["error"])
    stages = [message["stage"] for message in report["watched"]]
    assert stages == ["plan", "drafts", "drafts", "drafts", "critique", "answer"]
    senders = {message["stage"]: message["sender"] for message in report["watched"]}
    assert senders["plan"].startswith("inferlet:") and "@" not in senders["plan"]
    assert senders["critique"].endswith("@node-2")
    remote = [agent["role"] for agent in report["agents"] if agent.get("remote")]
    assert remote == ["writer", "writer", "writer", "critic"]


@pytest.mark.model
def test_the_cluster_bench_compares_policies_and_node_counts_on_the_nodes(
    up: Up, capsys: pytest.CaptureFixture[str]
) -> None:
    workers = [up.node(n)["http_url"] for n in ("node-1", "node-2")]
    argv = ["bench", "cluster", "--workers", *workers, "--requests", "4", "--prompts", "2"]
    argv += ["--prompt-words", "40", "--tokens", "2", "--concurrency", "2", "--repeats", "1"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    configs = {(c["nodes"], c["policy"]): c for c in result["configs"]}
    assert sorted(configs) == [(1, "cache_aware"), (2, "cache_aware"), (2, "round_robin")]
    for config in configs.values():
        [measured] = config["rounds"]
        assert measured["tokens_per_s"] > 0 and measured["first_token_p50_ms"] > 0
        assert 0 <= measured["prefix_hit_rate"] <= 1
        assert sum(measured["requests_per_node"]) == 4
    assert len(configs[(1, "cache_aware")]["rounds"][0]["requests_per_node"]) == 1
    assert [r["name"] for r in result["ratios"]] == [
        "2 nodes, cache_aware / 2 nodes, round_robin",
        "2 nodes, cache_aware / 1 node, cache_aware",
    ]
    assert all(r["tokens_per_s"]["median"] > 0 for r in result["ratios"])


@pytest.mark.model
async def test_what_redis_acknowledged_survives_its_crash_and_a_stale_cache_serves_only_owners(
    up: Up,
) -> None:
    added = await trio.to_thread.run_sync(lambda: pie("auth", "add", "ada", "--cluster", up.redis))
    assert added.returncode == 0, added.stderr
    users = redis_cli(up.redis, "HGETALL", "pie:users")
    one, two = up.node("node-1")["ws_url"], up.node("node-2")["ws_url"]
    async with connect(one, user="ada") as client:
        await client.install(program(), name="echo", version="1.0")
    assert await launch(one, "ada", "echo", "e before") == "e before"  # node-1 holds it now

    redis = up.child("redis-server")
    redis.kill()  # SIGKILL: only what reached the append-only file is left
    await trio.to_thread.run_sync(
        lambda: wait_for(lambda: "Redis is back" in up.said(), 60, "Redis started again")
    )
    assert up.child("redis-server").pid != redis.pid
    assert redis_cli(up.redis, "HGETALL", "pie:users") == users, "the user and its token"
    assert await launch(two, "ada", "echo", "e after") == "e after", "node-2 read the binding"
    for node in (one, two):
        async with connect(node, user="bob") as client:
            with pytest.raises(NoSuchProgram):
                await client.launch("echo", "e")
    await trio.to_thread.run_sync(
        lambda: wait_for(lambda: node_ids(up.redis) == ["node-1", "node-2"], 30, "both listed")
    )


@pytest.mark.model
async def test_a_node_stopped_with_sigterm_leaves_at_once_and_then_finishes_its_work(
    up: Up,
) -> None:
    node = up.child("node-2/pie.toml")
    async with connect(up.node("node-2")["ws_url"], user="ada") as client:
        installed = await client.install(program(), name="echo", version="1.0")
        waiting = await client.launch(installed.hash, "p")  # returns once it gets a message
        node.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        await trio.to_thread.run_sync(
            lambda: wait_for(lambda: node_ids(up.redis) == ["node-1"], 10, "node-2 gone")
        )
        assert time.monotonic() - stopped < LEAVE_SECONDS
        assert node.is_running(), "it left before it stopped: its inferlet still runs"
        await waiting.send("go")
        with trio.fail_after(30):
            outcome = await waiting.result()
    assert outcome.ok and outcome.result == "fine"
    await trio.to_thread.run_sync(lambda: node.wait(60))  # its code: in what up says below
    await trio.to_thread.run_sync(
        lambda: wait_for(
            lambda: "node-2 exited with 0; the router dropped it" in up.said(), 10, "told"
        )
    )
    router = str(up.urls["router"]).removesuffix("/v1")
    workers = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    assert [w["url"] for w in workers] == [up.node("node-1")["http_url"]]


@pytest.mark.model
def test_ctrl_c_stops_every_part_and_leaves_no_process(up: Up) -> None:
    running = psutil.Process(up.process.pid).children(recursive=True)
    lines = [" ".join(p.cmdline())[:60] for p in running]
    assert len([line for line in lines if "sglang" in line]) == 1, lines
    assert len([line for line in lines if "redis-server" in line]) == 1, lines
    assert len([line for line in lines if "pie.cli serve" in line]) == 1, lines
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(120) == 0, up.said()
    assert [p for p in running if p.is_running()] == []
    assert leftovers(up.state) == []
    assert up.said().rstrip().endswith("pie: cluster stopped")


@pytest.mark.integration
def test_a_node_that_fails_at_start_ends_cluster_up_in_one_line_naming_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    done = pie(
        "cluster", "up", "--nodes", "2", "--router-port", "0", "--state-dir", str(state),
        "--model", str(tmp_path / "no-model-here"),
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.rstrip().splitlines()[-1]
    assert re.fullmatch(r"pie: node-[12] \(pie serve\) exited with 2 at start: pie: .+", last)
    assert "no-model-here" in last
    assert leftovers(state) == []


@pytest.mark.integration
def test_cluster_up_refuses_in_one_line_before_starting_anything(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    unreachable = pie("cluster", "up", "--state-dir", str(state), "--cluster", nowhere)
    no_nodes = pie("cluster", "up", "--state-dir", str(state), "--nodes", "0")
    with (state / "lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        taken = pie("cluster", "up", "--state-dir", str(state), "--router-port", "0")
    for done, code, line in [
        (unreachable, 1, f"pie: cannot reach Redis at {nowhere}: connection refused"),
        (no_nodes, 2, "pie: --nodes must be at least 1, got 0"),
        (taken, 1, f"pie: another `pie cluster up` uses {state}"),
    ]:
        assert (done.returncode, done.stderr.splitlines()[-1]) == (code, line), done.stderr
    assert leftovers(state) == [] and not (state / "redis").exists()


@pytest.mark.unit
def test_a_node_config_is_the_given_one_with_its_own_id_and_folders(tmp_path: Path) -> None:
    given = {
        "kv": {"num_pages": 64, "prefix_cache": "global"},
        "http": {"mounts": {"/a b": "echo@1.0"}},
        "models": [
            {"name": "m1", "path": "/x", "adapters": {"fr": "/fr"}},
            {"name": "m2", "path": "/y"},
        ],
        "sandbox": {"max_memory_mb": 1.5, "flag": True, "list": [1, 2], "text": 'q"\\\n'},
    }
    assert tomllib.loads(to_toml(given)) == given
    base = tmp_path / "base.toml"
    base.write_text(to_toml(given))
    node = tomllib.loads(node_config(str(base), "node-3", tmp_path / "node-3"))
    assert node["cluster"] == {"node_id": "node-3"}
    assert node["server"]["programs_dir"] == str(tmp_path / "node-3" / "programs")
    assert node["kv"] == {**given["kv"], "snapshots_dir": str(tmp_path / "node-3" / "snapshots")}
    assert node["models"] == given["models"]
