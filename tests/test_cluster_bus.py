"""The bus across nodes: two engines joined through a real Redis push and pull, publish and
subscribe as one bus, in order, with the local bus's bounds and its very refusals; what a queue
holds lives in Redis and is gone from it once pulled. Synthetic driver throughout."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.actors.bus import BusCore, BusLimits
from pie.actors.requester import Requester, RequestRefused
from pie.client import connect
from pie.cluster.bus import cluster_bus
from pie.cluster.store import open_store
from pie.config import ClusterConfig
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.events import bus as ev
from pie.events.kv import RequestFailed
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.redis_fixtures import RedisServer, redis_server  # noqa: F401
from tests.server_fixtures import serving

pytestmark = pytest.mark.integration

SMALL = BusLimits(
    max_message_bytes=1000, max_queue_messages=4, max_queue_bytes=4000, max_user_bytes=2000
)


@contextlib.asynccontextmanager
async def node(url: str, name: str, limits: BusLimits = SMALL) -> AsyncIterator[Engine]:
    config = ClusterConfig(redis=url, bus_poll_seconds=0.2)
    async with open_engine(driver=SyntheticDriver(), bus=cluster_bus(config, limits, name)) as e:
        yield e


@contextlib.asynccontextmanager
async def two_nodes(url: str, limits: BusLimits = SMALL) -> AsyncIterator[tuple[Engine, Engine]]:
    async with node(url, "node-a", limits) as a, node(url, "node-b", limits) as b:
        yield a, b


async def refusal(requester: Requester, make: Any, **fields: Any) -> tuple[str, str]:
    with pytest.raises(RequestRefused) as refused:
        await requester.call("bus", make, **fields)
    return refused.value.kind, refused.value.message


def local_refusal(core: BusCore, make: Any, **fields: Any) -> tuple[str, str]:
    """What the single-node bus answers to the same command."""
    (_, reply), *_ = core.handle(make(corr=1, requester="r", **fields))
    assert isinstance(reply, RequestFailed), reply
    return reply.kind, reply.message


@pytest.fixture(scope="module")
def switchboard(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "switchboard").read_bytes()


async def test_an_inferlet_on_one_node_works_through_jobs_a_client_pushes_on_another(
    tmp_path: Path,
    switchboard: bytes,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """Through the servers: the client's pushes on node a are charged to its user there, the
    worker on node b pulls them in order and broadcasts each, and a watcher on a hears them."""
    config = ClusterConfig(redis=redis_server.url, bus_poll_seconds=0.2)
    limits = BusLimits()
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    node_a.mkdir(), node_b.mkdir()
    with trio.fail_after(90):
        async with (
            serving(node_a, bus=cluster_bus(config, limits, "node-a")) as a,
            serving(node_b, bus=cluster_bus(config, limits, "node-b")) as b,
            connect(a.url) as on_a,
            connect(b.url) as on_b,
        ):
            b.engine.programs.add(switchboard, "switchboard")
            watch = await on_a.watch("done")
            worker = await on_b.launch(
                "switchboard", {"mode": "work", "queue": "jobs", "topic": "done"}
            )
            for job in ("wash", "dry", "fold", "stop"):
                await on_a.push("jobs", job)
            outcome = await worker.result()
            answers = [await watch.next() for _ in range(3)]
            await watch.stop()
    assert outcome.ok and outcome.result == "3"
    sender = f"inferlet:{worker.instance}@node-b"
    assert [(m.sender, m.message) for m in answers if m] == [
        (sender, "WASH"),
        (sender, "DRY"),
        (sender, "FOLD"),
    ]


async def test_messages_pushed_on_one_node_are_pulled_on_the_other_in_order(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    with trio.fail_after(30):
        async with two_nodes(redis_server.url) as (a, b):
            async with a.requester() as pusher, b.requester() as puller:
                for i in range(4):
                    await pusher.push("jobs", f"job {i}")
                assert [await puller.pull("jobs") for _ in range(4)] == [
                    f"job {i}" for i in range(4)
                ]


async def test_a_pull_waiting_on_one_node_is_served_by_a_push_on_the_other(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    pulled: list[str] = []
    with trio.fail_after(30):
        async with two_nodes(redis_server.url) as (a, b):
            async with a.requester() as pusher, b.requester() as puller:

                async def pull_three() -> None:
                    for _ in range(3):
                        pulled.append(await puller.pull("later"))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pull_three)
                    await trio.sleep(0.3)  # the first pull is waiting on node b
                    assert b.bus.statistics().waiting_pulls == 1
                    for word in ("one", "two", "three"):
                        await pusher.push("later", word)
    assert pulled == ["one", "two", "three"]


async def test_a_departed_puller_takes_nothing_and_the_next_one_gets_the_message(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    with trio.fail_after(30):
        async with two_nodes(redis_server.url) as (a, b):
            async with a.requester() as pusher, b.requester() as staying:
                async with trio.open_nursery() as nursery:
                    async with b.requester() as leaving:
                        nursery.start_soon(leaving.pull, "q")
                        await trio.sleep(0.3)
                        nursery.cancel_scope.cancel()
                assert b.bus.statistics().waiting_pulls == 0
                await pusher.push("q", "kept")
                assert await staying.pull("q") == "kept"


async def test_a_publish_reaches_subscribers_on_both_nodes_in_order(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    heard: dict[str, list[tuple[str, str]]] = {"a": [], "b": []}
    sent = [f"news {i}" for i in range(20)]
    with trio.fail_after(30):
        async with two_nodes(redis_server.url) as (a, b):
            async with a.requester() as on_a, b.requester() as on_b, a.requester() as speaker:
                await on_a.subscribe("t", lambda m: heard["a"].append((m.sender, m.message)))
                await on_b.subscribe("t", lambda m: heard["b"].append((m.sender, m.message)))
                for text in sent:
                    await speaker.publish("t", text)
                while len(heard["a"]) < 20 or len(heard["b"]) < 20:
                    await trio.sleep(0.05)
    assert [text for _, text in heard["a"]] == sent
    assert [text for _, text in heard["b"]] == sent
    assert {who for who, _ in heard["a"]} == {speaker.address}
    assert {who for who, _ in heard["b"]} == {f"{speaker.address}@node-a"}


async def test_publishes_from_both_nodes_reach_every_subscriber_in_one_order(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    heard: dict[str, list[str]] = {"a": [], "b": []}
    with trio.fail_after(30):
        async with two_nodes(redis_server.url) as (a, b):
            async with a.requester() as on_a, b.requester() as on_b:
                await on_a.subscribe("mix", lambda m: heard["a"].append(m.message))
                await on_b.subscribe("mix", lambda m: heard["b"].append(m.message))
                async with trio.open_nursery() as nursery:
                    for who, engine in (("a", a), ("b", b)):
                        nursery.start_soon(_publish_many, engine, who)
                while len(heard["a"]) < 40 or len(heard["b"]) < 40:
                    await trio.sleep(0.05)
    assert heard["a"] == heard["b"]
    for who in ("a", "b"):
        assert [m for m in heard["a"] if m.startswith(who)] == [f"{who}{i}" for i in range(20)]


async def _publish_many(engine: Engine, prefix: str) -> None:
    async with engine.requester() as speaker:
        for i in range(20):
            await speaker.publish("mix", f"{prefix}{i}")


async def test_an_oversized_message_is_refused_as_the_local_bus_refuses_it(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    big = "x" * 1001
    core = BusCore(SMALL)
    with trio.fail_after(30):
        async with two_nodes(redis_server.url) as (a, _):
            async with a.requester() as sender:
                for make, fields in (
                    (ev.Push, {"queue": "q", "message": big}),
                    (ev.Publish, {"topic": "t", "message": big}),
                ):
                    expected = local_refusal(core, make, **fields)
                    assert expected[0] == "too-large"
                    assert await refusal(sender, make, **fields) == expected


async def test_a_name_longer_than_the_cluster_keeps_is_refused_invalid(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    long = "n" * 1025
    with trio.fail_after(30):
        async with node(redis_server.url, "node-a") as a, a.requester() as sender:
            for make, fields in (
                (ev.Push, {"queue": long, "message": "m"}),
                (ev.Publish, {"topic": long, "message": "m"}),
            ):
                kind, message = await refusal(sender, make, **fields)
                assert kind == "invalid"
                assert "name is 1025 bytes of UTF-8" in message
                assert "cluster.bus_max_name_bytes" in message
            await sender.push("n" * 1024, "the longest name is fine")


async def test_a_full_queue_refuses_with_the_local_overrun_on_either_node(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    core = BusCore(SMALL)
    with trio.fail_after(30):
        async with two_nodes(redis_server.url) as (a, b):
            async with a.requester() as on_a, b.requester() as on_b:
                for i in range(4):
                    fields = {"queue": "full", "message": f"m{i}", "user": f"u{i}"}
                    core.handle(ev.Push(corr=1, requester="r", **fields))
                    await (on_a if i % 2 else on_b).call("bus", ev.Push, **fields)
                fields = {"queue": "full", "message": "one more", "user": "u9"}
                expected = local_refusal(core, ev.Push, **fields)
                assert expected[0] == "overrun"
                assert await refusal(on_b, ev.Push, **fields) == expected
                assert await on_a.pull("full") == "m0"
                await on_b.call("bus", ev.Push, **fields)  # room again


async def test_a_user_over_quota_is_refused_on_every_node_while_another_user_is_served(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    core = BusCore(SMALL)
    heavy = "h" * 800  # charged 928 bytes: two fit in 2000, a third does not
    with trio.fail_after(30):
        async with two_nodes(redis_server.url) as (a, b):
            async with a.requester() as on_a, b.requester() as on_b:
                for queue in ("q1", "q2"):
                    fields = {"queue": queue, "message": heavy, "user": "greedy"}
                    core.handle(ev.Push(corr=1, requester="r", **fields))
                    await on_a.call("bus", ev.Push, **fields)
                fields = {"queue": "q3", "message": heavy, "user": "greedy"}
                expected = local_refusal(core, ev.Push, **fields)
                assert expected[0] == "quota"
                assert await refusal(on_b, ev.Push, **fields) == expected
                await on_b.call("bus", ev.Push, queue="q3", message="fine", user="polite")
                assert await on_a.pull("q3") == "fine"
                assert await on_b.pull("q1") == heavy  # gives back the greedy user's bytes
                await on_b.call("bus", ev.Push, **fields)


async def test_redis_holds_nothing_for_queues_once_they_are_pulled(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    with trio.fail_after(30):
        async with two_nodes(redis_server.url) as (a, b):
            async with a.requester() as on_a, b.requester() as on_b:
                await on_a.call("bus", ev.Push, queue="q", message="é" * 10, user="u")
                async with open_store(redis_server.url, 3.0) as store:
                    assert await bus_keys(store) == [
                        b"pie:bus:q:q",
                        b"pie:bus:qb:q",
                        b"pie:bus:qc:q",
                        b"pie:bus:stream",
                        b"pie:bus:u:u",
                    ]
                    assert int(await store.client.get("pie:bus:u:u")) == 20 + 128
                    assert await on_b.pull("q") == "é" * 10
                    assert await bus_keys(store) == [b"pie:bus:stream"]


async def test_the_stream_every_node_reads_is_capped(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    config = ClusterConfig(redis=redis_server.url, bus_stream_entries=16)
    with trio.fail_after(60):
        async with open_engine(driver=SyntheticDriver(), bus=cluster_bus(config, SMALL, "a")) as a:
            async with a.requester() as speaker:
                for i in range(500):
                    await speaker.publish("chatter", str(i))
                async with open_store(redis_server.url, 3.0) as store:
                    # Trimmed approximately: in whole nodes of Redis's radix tree (100 entries).
                    assert await store.client.xlen("pie:bus:stream") <= 16 + 100


async def bus_keys(store: Any) -> list[bytes]:
    return sorted(await store.client.keys("pie:bus:*"))


async def test_while_redis_is_away_a_push_fails_unavailable_and_then_the_bus_carries_on(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    config = ClusterConfig(redis=redis_server.url, bus_poll_seconds=0.2, connect_timeout_seconds=1)
    with trio.fail_after(60):
        async with open_engine(driver=SyntheticDriver(), bus=cluster_bus(config, SMALL, "a")) as a:
            async with a.requester() as on_a, a.requester() as waiting:
                pulled: list[str] = []

                async def pull() -> None:
                    pulled.append(await waiting.pull("w"))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pull)
                    redis_server.stop()
                    kind, message = await refusal(on_a, ev.Push, queue="q", message="lost")
                    assert kind == "unavailable"
                    assert message.startswith(f"the cluster's bus at {redis_server.url} did not")
                    assert "\n" not in message
                    redis_server.start()
                    await on_a.push("q", "after")
                    assert await on_a.pull("q") == "after"
                    await on_a.push("w", "the pull waiting through the restart")
                assert pulled == ["the pull waiting through the restart"]
