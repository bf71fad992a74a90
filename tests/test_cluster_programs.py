"""Programs shared by the nodes of a cluster through a real Redis: installed through one node,
launched through another by name and by hash; names owned per user and never rebound, through
either node; the cluster's size limits; and a node that keeps serving its cached programs, to
their owners only, while Redis is away, and shares them again once Redis is back empty."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import wasmtime

from pie.client import connect
from pie.client.errors import NoSuchProgram, ServerError
from pie.client.local import LocalServer
from pie.cluster.programs import SharedNameTaken
from pie.cluster.status import read_status
from pie.config import EngineConfig, with_overrides
from pie.server.app import Server
from pie.server.clustered import open_shared_state
from tests.model_fixtures import default_model_dir  # noqa: F401
from tests.redis_fixtures import RedisServer, redis_server  # noqa: F401
from tests.server_fixtures import serving

GUEST = (Path(__file__).parent / "wat_guests" / "host_calls.wat").read_text()
"""Input "e…" returns it unchanged."""


@pytest.fixture(scope="module")
def program() -> bytes:
    return bytes(wasmtime.wat2wasm(GUEST))


def variant(wasm: bytes, tag: bytes) -> bytes:
    """`wasm` with a custom section holding `tag`: the same program, other bytes."""
    name = b"pie-test"
    body = bytes([len(name)]) + name + tag
    return wasm + b"\x00" + bytes([len(body)]) + body


@contextlib.asynccontextmanager
async def node(tmp_path: Path, url: str, name: str, **keys: Any) -> AsyncIterator[Server]:
    """A server on the synthetic driver, clustered through `url`, with its own programs folder
    and its own Redis client (as a separate process would have)."""
    cluster = with_overrides(EngineConfig(), cluster={"redis": url, **keys}).cluster
    folder = tmp_path / name
    folder.mkdir()
    async with open_shared_state(cluster) as shared:
        async with serving(folder, shared_programs=shared.programs) as server:
            yield server


async def run(url: str, user: str, program: str, text: str) -> Any:
    async with connect(url, user=user) as client:
        inferlet = await client.launch(program, text)
        with trio.fail_after(30):
            return await inferlet.result()


@pytest.mark.integration
async def test_installed_through_one_node_runs_on_another_by_name_and_by_hash(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    async with node(tmp_path, url, "a") as a, node(tmp_path, url, "b") as b:
        async with connect(a.url, user="ada") as client:
            info = await client.install(program, name="echo", version="1.0")
        assert info.hash == hashlib.sha256(program).hexdigest()
        assert not b.engine.programs.holds(info.hash), "node b has not seen it yet"
        on_a = await run(a.url, "ada", "echo", "e from a")
        by_name = await run(b.url, "ada", "echo@1.0", "e from a")
        latest = await run(b.url, "ada", "echo", "e from a")
        by_hash = await run(b.url, "bob", info.hash, "e from a")
        async with connect(a.url, user="ada") as client:
            newer = await client.install(variant(program, b"2"), name="echo", version="2.0")
        async with connect(b.url, user="ada") as client:
            older = await client.query_program("echo@1.0")
            latest_now = await client.query_program("echo")
    assert on_a.ok and on_a.result == "e from a"
    assert [(o.status, o.result) for o in (by_name, latest, by_hash)] == [
        ("returned", "e from a")
    ] * 3
    shown = await read_status(url, 3.0, 256)
    assert [(p.user, p.name, p.version, p.hash, p.size) for p in shown.programs] == [
        ("ada", "echo", "1.0", info.hash, len(program)),
        ("ada", "echo", "2.0", newer.hash, newer.size),
    ]
    assert [line.split()[:4] for line in shown.lines() if line.startswith("program")] == [
        ["program", "ada", "echo@1.0", info.hash[:12]],
        ["program", "ada", "echo@2.0", newer.hash[:12]],
    ]
    assert older is not None and older.hash == info.hash
    assert latest_now is not None and latest_now.hash == newer.hash, "the cluster's latest"
    kept = sorted(p.name for p in (tmp_path / "b" / "programs").glob("*.wasm"))
    assert kept == sorted([f"{info.hash}.wasm", f"{newer.hash}.wasm"]), "b cached both on disk"


@pytest.mark.integration
async def test_a_users_names_are_its_own_and_never_rebound_through_any_node(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    other = variant(program, b"v2")
    async with node(tmp_path, url, "a") as a, node(tmp_path, url, "b") as b:
        async with connect(a.url, user="ada") as client:
            await client.install(program, name="echo", version="1.0")
        for server in (a, b):
            async with connect(server.url, user="bob") as client:
                with pytest.raises(NoSuchProgram):
                    await client.launch("echo", "e")
                with pytest.raises(NoSuchProgram):
                    await client.launch("echo@1.0", "e")
        for server in (b, a):
            async with connect(server.url, user="ada") as client:
                with pytest.raises(ServerError) as refused:
                    await client.install(other, name="echo", version="1.0")
                assert refused.value.kind == "name-taken"
                assert "echo@1.0 is already installed" in str(refused.value)
        async with connect(b.url, user="bob") as client:
            mine = await client.install(other, name="echo", version="1.0")
        assert mine.hash == hashlib.sha256(other).hexdigest(), "bob's own echo is his"
        ada = await run(a.url, "ada", "echo", "e ada")
        bob = await run(a.url, "bob", "echo", "e bob")
        assert (ada.result, bob.result) == ("e ada", "e bob")
        assert (
            a.engine.programs.bound("echo", "1.0", owner="ada")
            == hashlib.sha256(program).hexdigest()
        )
        assert a.engine.programs.bound("echo", "1.0", owner="bob") == mine.hash


@pytest.mark.integration
async def test_two_nodes_binding_one_name_at_once_to_different_bytes_one_wins(
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    cluster = with_overrides(EngineConfig(), cluster={"redis": redis_server.url}).cluster
    versions = [variant(program, bytes([65 + i])) for i in range(8)]
    outcomes: list[str] = []
    async with open_shared_state(cluster) as one, open_shared_state(cluster) as two:

        async def bind(shared: Any, wasm: bytes) -> None:
            digest = hashlib.sha256(wasm).hexdigest()
            try:
                await shared.programs.bind("ada", "echo", "1.0", wasm, digest)
            except SharedNameTaken:
                outcomes.append("taken")
            else:
                outcomes.append(digest)

        async with trio.open_nursery() as nursery:
            for index, wasm in enumerate(versions):
                nursery.start_soon(bind, (one, two)[index % 2], wasm)
        bound = await one.programs.binding("ada", "echo@1.0")
    winners = [o for o in outcomes if o != "taken"]
    assert len(winners) == 1 and outcomes.count("taken") == 7
    assert bound is not None and bound.hash == winners[0]


@pytest.mark.integration
async def test_the_cluster_refuses_programs_past_its_limits(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    big = variant(program, b"x" * 100) + b"\x00\x7f" + bytes([6]) + b"filler" + b"y" * 120
    async with node(tmp_path, redis_server.url, "a", max_user_programs_mb=1) as a:
        shared = a.node_programs.shared
        shared.max_user_bytes = len(program) + 50  # a quota this test can fill
        async with connect(a.url, user="ada") as client:
            await client.install(program, name="echo", version="1.0")
            with pytest.raises(ServerError) as refused:
                await client.install(big, name="echo", version="2.0")
            again = await client.install(program, name="echo", version="1.1")
        assert refused.value.kind == "quota"
        assert "past" in str(refused.value) and "max_user_programs_mb" in str(refused.value)
        assert again.hash == hashlib.sha256(program).hexdigest(), "the same bytes count once"
        shared.max_program_bytes = len(program) - 1
        async with connect(a.url, user="cy") as client:
            with pytest.raises(ServerError) as too_big:
                await client.install(program, name="echo", version="1.0")
        assert too_big.value.kind == "too-large" and "max_program_mb" in str(too_big.value)


@pytest.mark.integration
async def test_with_redis_away_a_node_serves_its_cached_programs_to_their_owners_only(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    url = redis_server.url
    async with node(tmp_path, url, "a", connect_timeout_seconds=1.0) as a:
        async with node(tmp_path, url, "b", connect_timeout_seconds=1.0) as b:
            async with connect(a.url, user="ada") as client:
                await client.install(program, name="echo", version="1.0")
            assert (await run(b.url, "ada", "echo", "e cached")).ok, "b fetches and caches it"
            redis_server.stop()
            owner = await run(b.url, "ada", "echo", "e while away")
            async with connect(b.url, user="bob") as client:
                with pytest.raises(NoSuchProgram):
                    await client.launch("echo", "e")
                with pytest.raises(ServerError) as refused:
                    await client.install(variant(program, b"b"), name="mine", version="1.0")
            assert refused.value.kind == "cluster-unavailable"
            assert f"Redis at {url} does not answer" in str(refused.value)
            redis_server.start()  # back, empty: nothing was saved
            assert (await run(b.url, "ada", "echo", "e back")).result == "e back"
            async with connect(b.url, user="bob") as client:
                with pytest.raises(NoSuchProgram):
                    await client.launch("echo", "e")
            async with node(tmp_path, url, "c") as c:
                again = await run(c.url, "ada", "echo", "e on a new node")
    assert again.result == "e on a new node", "b shared ada's echo again when its owner used it"
    assert owner.ok and owner.result == "e while away"


@pytest.mark.model
async def test_two_pie_serve_nodes_share_an_installed_program(
    tmp_path: Path,
    default_model_dir: Path,  # noqa: F811
    redis_server: RedisServer,  # noqa: F811
    program: bytes,
) -> None:
    started = []
    for name in ("a", "b"):
        config = tmp_path / f"{name}.toml"
        config.write_text(
            f'[kv]\nnum_pages = 16\n[server]\nprograms_dir = "{tmp_path / name}"\n'
            f'[sandbox]\ncache_dir = "{tmp_path / name / "components"}"\n'
        )
        args = ["--config", str(config), "--cluster", redis_server.url]
        started.append(
            await trio.to_thread.run_sync(
                lambda a=args: LocalServer.start(default_model_dir, args=a)
            )
        )
    a, b = started
    try:
        async with connect(a.url, user="ada") as client:
            info = await client.install(program, name="echo", version="1.0")
        by_name = await run(b.url, "ada", "echo", "e by name")
        by_hash = await run(b.url, "ada", info.hash, "e by hash")
        async with connect(b.url, user="bob") as client:
            with pytest.raises(NoSuchProgram):
                await client.launch("echo", "e")
    finally:
        for server in started:
            await trio.to_thread.run_sync(server.stop)
    assert (by_name.result, by_hash.result) == ("e by name", "e by hash")
