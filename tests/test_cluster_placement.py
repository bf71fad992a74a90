"""WebSocket launches placed across the nodes of a cluster (a real Redis, nodes on the synthetic
driver): the choice itself; a loaded node sending a launch to the least-loaded one and the
Python client and the CLI following; a launch naming a snapshot going to its node; no redirect
twice; attaching through any node; a node on its own unchanged; and a killed node's clients
told so, launching again on the node left."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import coredis
import pytest
import trio
import wasmtime

from pie.client import connect
from pie.client.errors import ConnectionLost, PieError, ServerError
from pie.client.peers import Peers
from pie.cluster.placement import choose_node, snapshot_key
from pie.cluster.records import NodeLoad, NodeRecord, node_key
from pie.wire import messages as msg
from tests.cluster_nodes import NodeProcess, placed_node
from tests.redis_fixtures import RedisServer, redis_server  # noqa: F401
from tests.server_fixtures import Raw, serving
from tests.server_fixtures import connect as open_ws

GUEST = (Path(__file__).parent / "wat_guests" / "host_calls.wat").read_text()
"""Input "p" waits for one session message, then returns "fine"; "e…" returns its input."""


@pytest.fixture(scope="module")
def program() -> bytes:
    return bytes(wasmtime.wat2wasm(GUEST))


def record(node_id: str, inferlets: int = 0, ws_url: str = "ws://x:1", **load: int) -> NodeRecord:
    return NodeRecord(node_id=node_id, ws_url=ws_url, load=NodeLoad(inferlets=inferlets, **load))


def node_of(instance: str) -> str:
    return instance.rpartition("@")[2]


# -- the choice ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_launch_goes_to_the_least_loaded_node_only_past_the_slack() -> None:
    nodes = [record("a", 3), record("b", 1), record("c", 0, free_pages=5), record("d", 0)]
    here = NodeLoad(inferlets=3)
    assert choose_node("a", here, nodes, [], slack=1) == nodes[2], "fewest, then most free"
    assert choose_node("a", here, nodes, [], slack=3) is None, "a difference within the slack"
    assert choose_node("a", NodeLoad(inferlets=0), nodes, [], slack=0) is None, "ties stay"
    crowded = choose_node("a", here, nodes, [], slack=1, sent={"c": 2, "d": 1})
    assert crowded == nodes[1], "launches sent since the record count against it"


@pytest.mark.unit
def test_only_live_nodes_with_a_websocket_url_are_chosen() -> None:
    nodes = [record("a", 5), record("b", 0, ws_url="")]
    assert choose_node("a", NodeLoad(inferlets=5), nodes, [], slack=0) is None
    assert choose_node("a", NodeLoad(inferlets=5), nodes, ["gone"], slack=0) is None


@pytest.mark.unit
def test_the_node_holding_most_named_snapshots_wins_over_load() -> None:
    nodes = [record("a", 0), record("b", 9), record("c", 0)]
    here = NodeLoad(inferlets=0)
    assert choose_node("a", here, nodes, ["b"], slack=0) == nodes[1]
    assert choose_node("a", here, nodes, ["c", "b", "b"], slack=0) == nodes[1]
    assert choose_node("a", here, nodes, ["b", "a"], slack=0) is None, "a tie stays here"
    assert choose_node("a", here, nodes, ["gone"], slack=0) is None, "a lost holder: by load"


@pytest.mark.unit
async def test_the_client_never_follows_a_redirect_from_tls_to_clear_text() -> None:
    def opener(url: str) -> Any:
        raise AssertionError(f"no connection should open to {url}")

    async with trio.open_nursery() as nursery:
        peers = Peers(nursery, opener, "wss://a.example:8443")
        with pytest.raises(PieError) as refused:
            await peers.get(msg.Redirect(corr=1, node="b", url="ws://b.example:8080"))
    assert "node b at ws://b.example:8080 without TLS" in str(refused.value)


# -- nodes on one Redis --------------------------------------------------------------------------


async def hold(client: object, count: int) -> list[object]:
    """`count` inferlets launched through `client` that wait for a message."""
    return [await client.launch("echo", "p") for _ in range(count)]  # type: ignore[attr-defined]


async def finish(inferlets: list[object]) -> list[str]:
    results = []
    for inferlet in inferlets:
        await inferlet.send("go")  # type: ignore[attr-defined]
        with trio.fail_after(30):
            results.append((await inferlet.result()).result)  # type: ignore[attr-defined]
    return results


async def install(url: str, program: bytes) -> None:
    async with connect(url, user="ada") as client:
        await client.install(program, name="echo", version="1.0")


@pytest.mark.integration
async def test_a_loaded_node_sends_a_launch_to_the_least_loaded_and_the_client_follows(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    async with placed_node(tmp_path, url, "a") as a, placed_node(tmp_path, url, "b") as b:
        await install(a.url, program)
        async with connect(a.url, user="ada") as client:
            inferlets = await hold(client, 4)
            inferlets.append(await client.launch("echo", "p", here=True))  # loaded, but asked
            ids = [i.instance for i in inferlets]  # type: ignore[attr-defined]
            assert b.statistics().connections == 1, "one connection to b, however many there"
            assert await finish(inferlets) == ["fine"] * 5
        with trio.fail_after(5):
            while b.statistics().connections:
                await trio.sleep(0.02)
    # a runs 0, then 1 (within the slack of 1), then 2: the third goes to b; the fourth stays,
    # b counting the launch a sent it although b's record may not show it yet; the fifth asks
    # to run where the client is connected.
    assert [node_of(i) for i in ids] == ["a", "a", "b", "a", "a"]
    assert a.placer is not None and a.placer.redirected == 1


@pytest.mark.integration
async def test_a_launch_naming_a_snapshot_runs_on_the_node_holding_it(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    async with placed_node(tmp_path, url, "a") as a, placed_node(tmp_path, url, "b") as b:
        await install(a.url, program)
        model = a.engine.models[0].name
        async with coredis.Redis.from_url(url) as redis:
            for name, node in (("sys", "b"), ("mine", "a"), ("lost", "c")):
                entry = {"model": model, "user": "ada", "name": name, "node": node}
                await redis.hset(snapshot_key(model, "ada", name), entry)
        async with connect(a.url, user="ada") as on_a, connect(b.url, user="ada") as on_b:
            to_b = await on_a.launch("echo", "e1", snapshots=["sys"])
            to_a = await on_b.launch("echo", "e2", snapshots=["mine"])
            stays = await on_a.launch("echo", "e3", snapshots=["lost", "unknown"])
            results = [(await i.result()).result for i in (to_b, to_a, stays)]
            with pytest.raises(ServerError) as many:
                await on_a.launch("echo", "e", snapshots=[str(n) for n in range(17)])
    assert [node_of(i.instance) for i in (to_b, to_a, stays)] == ["b", "a", "a"]
    assert results == ["e1", "e2", "e3"]
    assert many.value.kind == "bad-frame" and "placement_max_snapshots is 16" in str(many.value)


@pytest.mark.integration
async def test_a_placed_launch_is_never_redirected_again_and_local_placement_never_is(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    async with (
        placed_node(tmp_path, url, "a", placement_slack=0) as a,
        placed_node(tmp_path, url, "b") as b,
        placed_node(tmp_path, url, "c", placement="local") as c,
    ):
        await install(a.url, program)
        async with connect(a.url, user="ada") as client:
            waiting = await hold(client, 1)
            async with await open_ws(a.url) as ws:
                raw = Raw(ws)
                await raw.next()  # Welcome
                await raw.call(msg.Authenticate, user="ada")
                sent = await raw.call(msg.Launch, program="echo", input="e")
                kept = await raw.call(msg.Launch, program="echo", input="e", placed=True)
            async with connect(c.url, user="ada") as on_c:
                local = await hold(on_c, 3)
                assert await finish(waiting + local) == ["fine"] * 4
    assert isinstance(sent, msg.Redirect) and sent.node in ("b", "c")
    assert sent.url in (b.url, c.url)
    assert isinstance(kept, msg.Launched) and node_of(kept.instance) == "a"
    assert [node_of(i.instance) for i in local] == ["c"] * 3  # type: ignore[attr-defined]


@pytest.mark.integration
async def test_an_inferlet_is_attached_to_and_driven_through_any_node(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    async with placed_node(tmp_path, url, "a") as a, placed_node(tmp_path, url, "b") as b:
        await install(a.url, program)
        async with connect(a.url, user="ada") as client:
            (first,) = await hold(client, 1)
            (second,) = await hold(client, 1)
            instance = first.instance  # type: ignore[attr-defined]
        async with connect(b.url, user="ada") as client:
            again = await client.attach(instance)
            await client.send(instance, "go")
            with trio.fail_after(30):
                outcome = await again.result()
            await client.terminate(second.instance)  # type: ignore[attr-defined]
            with pytest.raises(ServerError) as lost:
                await client.attach("i7@gone")
            async with connect(b.url, user="bob") as other:
                with pytest.raises(ServerError) as not_owner:
                    await other.attach(instance)
    assert node_of(instance) == "a" and (outcome.instance, outcome.result) == (instance, "fine")
    assert lost.value.kind == "node-lost"
    assert "i7@gone ran on node gone, which is no longer in the cluster" in str(lost.value)
    assert not_owner.value.kind == "not-owner"
    tracked = a.hub.tracked[second.instance]  # type: ignore[attr-defined]
    assert tracked.state == "ended" and tracked.engine_id == "i2"


@pytest.mark.integration
async def test_a_node_on_its_own_places_nothing_and_names_no_node(
    tmp_path: Path, program: bytes
) -> None:
    async with serving(tmp_path) as server, await open_ws(server.url) as ws:
        async with connect(server.url) as client:
            info = await client.install(program, name="echo")
        raw = Raw(ws)
        welcome = json.loads(await ws.get_message())
        launched = await raw.call(msg.Launch, program=info.hash, input="e", snapshots=("x",))
    assert "node" not in welcome, "the welcome reads as before"
    assert isinstance(launched, msg.Launched) and launched.instance == "i1"
    assert server.placer is None


@pytest.mark.integration
async def test_pie_submit_and_attach_follow_a_redirect(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    wasm, message = tmp_path / "echo.wasm", tmp_path / "go.txt"
    wasm.write_bytes(program)
    message.write_text("go")
    async with placed_node(tmp_path, url, "a", placement_slack=0) as a:
        async with placed_node(tmp_path, url, "b") as b, connect(a.url, user="ada") as client:
            await install(a.url, program)
            waiting = await hold(client, 1)
            command = [sys.executable, "-m", "pie.cli", "submit", str(wasm), "--server", a.url]
            command += ["--input", "p", "--file", str(message), "--user", "ada"]
            done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
            ran_on_b = [t.instance for t in b.hub.tracked.values()]
            command = [sys.executable, "-m", "pie.cli", "attach", ran_on_b[0], "--server", a.url]
            again = await trio.run_process(
                [*command, "--user", "ada"], capture_stdout=True, capture_stderr=True
            )
            await finish(waiting)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == "fine\n"
    assert [node_of(i) for i in ran_on_b] == ["b"]
    assert (again.returncode, again.stdout.decode()) == (0, "fine\n"), "replayed through a"


# -- faults --------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_a_redirect_to_a_node_that_cannot_be_reached_runs_the_launch_here(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    async with placed_node(tmp_path, url, "a", placement_slack=0) as a:
        await install(a.url, program)
        async with coredis.Redis.from_url(url) as redis:
            ghost = NodeRecord(node_id="ghost", ws_url="ws://127.0.0.1:9", renewed_at=time.time())
            await redis.set(node_key("ghost"), ghost.to_json(), px=60_000)
            await redis.sadd("pie:nodes", ["ghost"])
        async with connect(a.url, user="ada") as client:
            waiting = await hold(client, 1)
            with trio.fail_after(30):
                fallback = await client.launch("echo", "e here")
                outcome = await fallback.result()
            await finish(waiting)
    assert a.placer is not None and a.placer.redirected == 1, "it was sent to the ghost"
    assert node_of(fallback.instance) == "a" and outcome.result == "e here"


@pytest.mark.integration
async def test_a_killed_nodes_clients_get_an_error_naming_it_and_launch_again(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    b = await trio.to_thread.run_sync(NodeProcess, url, "b", tmp_path)
    try:
        async with placed_node(tmp_path, url, "a", placement_slack=0) as a:
            await install(a.url, program)
            async with connect(a.url, user="ada") as client, connect(b.url, user="ada") as direct:
                here, there = await hold(client, 2)
                on_b = await direct.launch("echo", "p")
                b.kill()
                errors = []
                with trio.fail_after(10):
                    for inferlet in (there, on_b):
                        with pytest.raises(ConnectionLost) as lost:
                            await inferlet.result()  # type: ignore[attr-defined]
                        errors.append(str(lost.value))
                with trio.fail_after(10):
                    # Sent to b while its record outlives it, the client launches on a.
                    again = await client.launch("echo", "e again")
                    outcome = await again.result()
                async with coredis.Redis.from_url(url) as redis:
                    with trio.fail_after(5):
                        while await redis.exists([node_key("b")]):
                            await trio.sleep(0.05)
                with pytest.raises(ServerError) as gone:
                    await client.attach(there.instance)  # type: ignore[attr-defined]
                await finish([here])
    finally:
        b.kill()
    assert node_of(there.instance) == "b"  # type: ignore[attr-defined]
    assert all(e.startswith(f"connection to node b at {b.url} closed") for e in errors), errors
    assert node_of(again.instance) == "a" and outcome.result == "e again"
    assert gone.value.kind == "node-lost" and "node b" in str(gone.value)
