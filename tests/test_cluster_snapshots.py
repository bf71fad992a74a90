"""Named snapshots across the nodes of a cluster, on a real Redis with in-process nodes serving a
tiny random Llama: the directory's entries written and removed as snapshots come and go (and
again by a node that rebuilt them at start), bounded per user; an open on another node refused
naming the holder ("place") or served by copying the KV pages over HTTP ("copy"), continuing
exactly as on the holder; a tampered chain, a foreign entry and a caller without the node
secret refused; a snapshot whose holder's record expired reported lost; `pie cluster status`."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio

from pie.actors.generate import generate
from pie.actors.requester import RequestRefused
from pie.cluster.records import NODES_INDEX, NodeLoad, NodeRecord
from pie.cluster.registry import Registration
from pie.cluster.status import read_status
from pie.cluster.store import open_store
from pie.config import config_from_dict
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.engine.replay import replay_cores
from pie.events.kv import DropSnapshots
from pie.events.sampling import Argmax, RawLogits, SamplingSlot
from pie.server.clustered import open_shared_state, share_snapshots, snapshot_routes
from pie.server.http import HttpFront
from pie.server.mounts import Mounts
from pie.server.snapshot_copy import COPY_PATH, MAGIC
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.redis_fixtures import RedisServer, redis_server  # noqa: F401
from tests.server_fixtures import PYTEST_CACHE, precompiled
from tests.tiny_models import save_tiny_model

PROMPT = [5, 9, 33, 71, 2, 18, 40, 41, 42, 43, 44, 45, 46, 47, 48, 60, 61, 62, 63, 64, 65]
"""21 tokens: five full pages of 4 and a partial one."""
NEXT = 77


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_model(folder, dict(model_type="llama"), seed=3)
    return folder


@pytest.fixture(scope="module")
def relay(built: Any) -> bytes:  # noqa: F811
    """The server tests' guest (built and compiled once for them all): it saves a text under a
    name, or opens a name and answers its token count or the error."""
    return precompiled(built(GUESTS / "relay").read_bytes())


def node_config(model_dir: Path, url: str, node_id: str, **cluster: Any) -> Any:
    return config_from_dict(
        {
            "sandbox": {"cache_dir": str(PYTEST_CACHE / "pie-components")},
            "model": {"path": str(model_dir), "dtype": "float32", "device": "cpu"},
            "kv": {"num_pages": 64, "page_size": 4, **cluster.pop("kv", {})},
            "cluster": {"redis": url, "node_id": node_id, **cluster},
        }
    )


@contextlib.asynccontextmanager
async def node(
    model_dir: Path, url: str, node_id: str, *, register: bool = True, **cluster: Any
) -> AsyncIterator[SimpleNamespace]:
    """An in-process clustered node: its engine, the directory wired to its kv actor, an HTTP
    front with the copy route and, with `register`, its record in Redis kept renewed."""
    config = node_config(model_dir, url, node_id, **cluster)
    async with (
        open_shared_state(config.cluster) as shared,
        open_engine(config) as engine,
        trio.open_nursery() as nursery,
    ):
        nodes = await share_snapshots(shared, config.cluster, engine, nursery)
        http = config_from_dict({"http": {"port": 0}}).http
        routes = snapshot_routes(shared, config.cluster, engine)
        front = HttpFront(engine, http, Mounts({}), host="127.0.0.1", routes=routes)
        await nursery.start(front.run)
        record = NodeRecord(node_id=node_id, ws_url=f"ws://{node_id}:8080", http_url=front.url)
        if register:
            registration = Registration(config.cluster, record, NodeLoad, nodes[0].redis_back)
            await nursery.start(registration.run)
        yield SimpleNamespace(
            engine=engine, front=front, shared=shared, snapshots=nodes[0], record=record
        )
        front.stop()
        nursery.cancel_scope.cancel()


async def register_once(url: str, record: NodeRecord, ttl: float) -> None:
    """The node's record, written once: it expires after `ttl` as a killed node's does."""
    async with open_store(url, 3.0) as store:
        await store.put(record.key, record.to_json(), ttl)
        await store.add_to_set(NODES_INDEX, record.node_id)


async def save(engine: Engine, name: str, user: str = "ada", prompt: list[int] = PROMPT) -> None:
    async with engine.requester() as requester:
        context = await requester.create_context(user=user)
        await requester.forward(context, prompt)
        await requester.save(context, name, user=user)


async def refusal(engine: Engine, name: str, user: str = "ada", **kw: Any) -> RequestRefused:
    async with engine.requester() as requester:
        with pytest.raises(RequestRefused) as refused:
            with trio.fail_after(30):
                await requester.open(name, user=user, **kw)
    return refused.value


async def continuation(engine: Engine, name: str, user: str = "ada") -> tuple[list[int], Any]:
    """The logits after NEXT and 8 greedy tokens, each from a context opened from `name`."""
    async with engine.requester() as requester:
        with trio.fail_after(60):
            probe = await requester.open(name, user=user)
            (logits,) = await requester.forward(
                probe, [NEXT], (SamplingSlot(index=0, op=RawLogits()),)
            )
            context = await requester.open(name, user=user)
            done = await generate(
                requester, [NEXT], max_tokens=8, sampler=Argmax(), context=context
            )
    return list(done.tokens), logits.values


async def entry(url: str, model: str, user: str, name: str) -> dict[str, str]:
    key = "pie:snap:" + hashlib.sha256(f"{model}\0{user}\0{name}".encode()).hexdigest()[:32]
    async with open_store(url, 3.0) as store:
        raw = await store.client.hgetall(key)
    return {k.decode(): v.decode() for k, v in raw.items()}


async def members(url: str, key: str) -> set[str]:
    async with open_store(url, 3.0) as store:
        return {m.decode() for m in await store.client.smembers(key)}


@pytest.mark.integration
async def test_the_directory_follows_saves_deletes_takes_drops_and_a_restart(
    tmp_path: Path,
    model_dir: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    kept = {"snapshots_dir": str(tmp_path / "snapshots")}
    async with node(model_dir, url, "node-a", kv=kept, max_user_snapshots=3) as a:
        model = a.engine.models[0].name
        for name in ("one", "two", "three"):
            await save(a.engine, name)
        written = await entry(url, model, "ada", "one")
        held = a.engine.kv.core.snapshots[("ada", "one")]
        with pytest.raises(RequestRefused, match="quota: .*max_user_snapshots"):
            await save(a.engine, "four")
        assert ("ada", "four") not in a.engine.kv.core.snapshots, "a refused save is undone"
        assert not (await entry(url, model, "ada", "four"))
        async with a.engine.requester() as requester:
            await requester.delete_snapshot("one", user="ada")
            await requester.open("two", user="ada", take=True)
        left = await members(url, "pie:snaps")
    assert set(written) == {"model", "user", "name", "node", "pages", "tokens", "chain", "saved_at"}
    assert (written["model"], written["user"], written["name"]) == (model, "ada", "one")
    assert (written["node"], written["pages"], written["tokens"]) == ("node-a", "6", "21")
    assert json.loads(written["chain"]) == [h.hex() for h in held.hashes] and len(held.hashes) == 5
    assert len(left) == 1, "one and two are gone, three is left"
    async with node(model_dir, url, "node-b", kv=kept) as b:
        # The same snapshots folder: b rebuilt "three" at start and names itself its holder.
        assert (await entry(url, model, "ada", "three"))["node"] == "node-b"
        async with b.engine.requester() as requester:
            await requester.call(b.engine.kv.address, DropSnapshots, user="ada")
        assert await members(url, "pie:snaps") == set()
        assert await members(url, "pie:snaps:user:ada") == set()


@pytest.mark.integration
async def test_place_names_the_holder_and_an_expired_holder_makes_the_snapshot_lost(
    model_dir: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    async with (
        node(model_dir, url, "node-a", register=False) as a,
        node(model_dir, url, "node-b") as b,
    ):
        await register_once(url, a.record, 1.5)
        await save(a.engine, "plan")
        elsewhere = await refusal(b.engine, "plan")
        take = await refusal(b.engine, "plan", take=True)
        shown = await read_status(url, 3.0, 256)
        await trio.sleep(1.6)  # node-a renews no more: its record expires
        lost = await refusal(b.engine, "plan")
        gone = await read_status(url, 3.0, 256)
        async with b.engine.requester() as requester:
            await requester.delete_snapshot("plan", user="ada")
        cleared = await read_status(url, 3.0, 256)
        [replayed] = replay_cores(b.engine.log.records(), only="kv")
    assert elsewhere.kind == "snapshot-elsewhere" and take.kind == "snapshot-elsewhere"
    assert "held by node-a (ws://node-a:8080)" in elsewhere.message
    assert lost.kind == "snapshot-lost"
    assert "node node-a, which is no longer in the cluster" in lost.message
    [listed] = shown.to_dict()["snapshots"]
    assert (listed["user"], listed["name"], listed["node"], listed["pages"]) == (
        "ada",
        "plan",
        "node-a",
        6,
    )
    assert listed["lost"] is False and gone.to_dict()["snapshots"][0]["lost"] is True
    assert [line for line in gone.lines() if line.startswith("snapshot")] == [
        f"snapshot  ada  plan  model={listed['model']}  node=node-a  pages=6"
        "  LOST (its node is gone)"
    ]
    assert cleared.snapshots == (), "deleting a lost snapshot clears its entry"
    assert replayed.result.mismatches == ()


@pytest.mark.integration
async def test_copy_brings_the_pages_over_and_continues_exactly_as_on_the_holder(
    model_dir: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    async with (
        node(model_dir, url, "node-a") as a,
        node(model_dir, url, "node-b", remote_snapshots="copy") as b,
    ):
        await save(a.engine, "essay")
        on_a = await continuation(a.engine, "essay")
        computed_before = b.engine.driver.statistics().tokens
        on_b = await continuation(b.engine, "essay")
        computed = b.engine.driver.statistics().tokens - computed_before
        copied = b.engine.kv.core.snapshots[("ada", "essay")]
        now = await entry(url, a.engine.models[0].name, "ada", "essay")
        leases = a.engine.kv.core.leases
        [replayed] = replay_cores(b.engine.log.records(), only="kv")
    assert on_b[0] == on_a[0], "the same greedy tokens"
    assert max(abs(x - y) for x, y in zip(on_a[1], on_b[1], strict=True)) < 1e-5
    assert computed == 1 + 8, "b computed the new tokens only, none of the snapshot's"
    assert copied.tokens == PROMPT and b.snapshots.copies == 1
    assert now["node"] == "node-b", "the copy is saved on b, which the directory now names"
    assert leases == {}, "the holder's pages are unpinned after the copy"
    # The copy's steps are the kv core's inputs and its hand-off to the directory an output:
    # its event log replays exactly.
    assert replayed.result.mismatches == () and replayed.result.inputs > 10


@pytest.mark.integration
async def test_a_bad_chain_a_foreign_entry_a_full_quota_and_a_caller_without_the_secret_fail(
    model_dir: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    small = {"snapshot_page_share": 0.05}  # 3 of 64 pages: the copy's 6 do not fit
    async with (
        node(model_dir, url, "node-a") as a,
        node(model_dir, url, "node-b", remote_snapshots="copy") as b,
        node(model_dir, url, "node-c", remote_snapshots="copy", kv=small) as c,
    ):
        model = a.engine.models[0].name
        await save(a.engine, "essay")
        over = await refusal(c.engine, "essay")
        free = b.engine.kv.core.pool.free
        good = await entry(url, model, "ada", "essay")
        key = "pie:snap:" + hashlib.sha256(f"{model}\0ada\0essay".encode()).hexdigest()[:32]
        chain = json.loads(good["chain"])
        chain[2] = "00" * 16
        async with open_store(url, 3.0) as store:
            await store.client.hset(key, {"chain": json.dumps(chain)})
            tampered = await refusal(b.engine, "essay")
            # bob's key carries ada's entry, then an entry naming bob that a holds only for ada.
            bob = "pie:snap:" + hashlib.sha256(f"{model}\0bob\0essay".encode()).hexdigest()[:32]
            await store.client.hset(bob, {**good, "user": "ada"})
            foreign = await refusal(b.engine, "essay", user="bob")
            await store.client.hset(bob, {**good, "user": "bob"})
            stale = await refusal(b.engine, "essay", user="bob")
        pages_left = b.engine.kv.core.pool.free
        async with httpx.AsyncClient(base_url=a.front.url, timeout=30) as client:
            query = {"model": model, "user": "ada", "name": "essay"}
            bare = await client.post(COPY_PATH, json=query)
            wrong = await client.post(COPY_PATH, json=query, headers={"x-pie-node-secret": "x"})
            right = await client.post(
                COPY_PATH, json=query, headers={"x-pie-node-secret": a.shared.secret}
            )
            as_bob = await client.post(
                COPY_PATH,
                json={**query, "user": "bob"},
                headers={"x-pie-node-secret": a.shared.secret},
            )
    assert over.kind == "snapshot-copy-failed" and "snapshot_quota" in over.message
    assert c.engine.kv.core.pool.free == 64 and not c.engine.kv.core.snapshots
    assert tampered.kind == "snapshot-copy-failed" and "do not hash" in tampered.message
    assert pages_left == free, "a refused copy leaves no page behind"
    assert foreign.kind == "no_such_snapshot"
    assert stale.kind == "snapshot-copy-failed" and "no snapshot named 'essay'" in stale.message
    assert [bare.status_code, wrong.status_code] == [403, 403]
    assert bare.json()["error"]["code"] == "forbidden"
    assert right.status_code == 200 and right.content.startswith(MAGIC)
    assert as_bob.status_code == 404


async def eventually(check: Any, seconds: float = 15.0) -> None:
    with trio.fail_after(seconds):
        while not await check():
            await trio.sleep(0.1)


@pytest.mark.integration
async def test_a_node_enters_its_snapshots_again_after_redis_restarts_empty(
    model_dir: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    quick = {"renew_seconds": 0.2, "ttl_seconds": 2.0, "connect_timeout_seconds": 1.0}
    async with node(model_dir, url, "node-a", **quick) as a:
        model = a.engine.models[0].name
        await save(a.engine, "kept")
        await save(a.engine, "gone")
        redis_server.stop()
        async with a.engine.requester() as requester:
            await requester.delete_snapshot("gone", user="ada")  # Redis away: local only
        with trio.fail_after(0.5):
            await save(a.engine, "fresh")  # waits on no Redis meanwhile
        redis_server.start()  # empty: every entry is lost

        async def kept_back() -> bool:
            return bool(await entry(url, model, "ada", "kept")) and bool(
                await entry(url, model, "ada", "fresh")
            )

        await eventually(kept_back)
        back = await entry(url, model, "ada", "kept")
        gone = await entry(url, model, "ada", "gone")
        # An entry left naming this node for a snapshot it no longer holds is cleared too.
        async with open_store(url, 3.0) as store:
            ghost = "pie:snap:" + hashlib.sha256(f"{model}\0ada\0ghost".encode()).hexdigest()[:32]
            await store.client.hset(ghost, {**back, "name": "ghost"})
            await store.client.sadd("pie:snaps", [ghost.removeprefix("pie:snap:")])
        a.snapshots.redis_back()

        async def ghost_gone() -> bool:
            return not await entry(url, model, "ada", "ghost")

        await eventually(ghost_gone)
        left = await members(url, "pie:snaps")
    assert back["node"] == "node-a" and not gone
    assert len(left) == 2, "kept and fresh"


async def program(engine: Engine, wasm: bytes, request: dict[str, Any]) -> Any:
    digest = engine.programs.add(wasm).hash
    with trio.fail_after(120):
        outcome = await engine.run_inferlet(digest, json.dumps(request), user="ada")
    assert outcome.ok, outcome.error
    return outcome.result  # a number as JSON, or the error as it is


@pytest.mark.integration
async def test_a_program_on_another_node_is_told_where_the_snapshot_is_or_gets_a_copy(
    model_dir: Path,
    relay: bytes,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    async with (
        node(model_dir, url, "node-a") as a,
        node(model_dir, url, "node-b") as b,
        node(model_dir, url, "node-c", remote_snapshots="copy") as c,
    ):
        saved = await program(a.engine, relay, {"mode": "save", "name": "notes", "text": "hi " * 9})
        on_b = await program(b.engine, relay, {"mode": "open", "name": "notes"})
        on_c = await program(c.engine, relay, {"mode": "open", "name": "notes"})
    assert on_b.startswith("error: snapshot-elsewhere: snapshot 'notes' is held by node-a")
    assert int(saved) == int(on_c) > 4, "c opened its copy, every token of it"


@pytest.mark.integration
async def test_an_engine_with_a_clusters_config_but_no_directory_answers_as_one_node() -> None:
    config = config_from_dict({"cluster": {"redis": "redis://127.0.0.1:1", "node_id": "x"}})
    async with open_engine(config, driver=SyntheticDriver()) as engine:
        assert engine.kv.core.directory == "kv.directory"
        refused = await refusal(engine, "plan")
    assert (refused.kind, refused.message) == ("no_such_snapshot", "no snapshot named 'plan'")
