"""Nodes joined through a real Redis: a node's record (URLs, models, load) shows in
`pie cluster status`, is renewed, drops out when the node stops renewing and is deleted when it
stops cleanly; an unreachable Redis ends `pie serve --cluster` in one line before the model
loads; a node without cluster settings never loads the Redis client."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.client.local import LocalServer
from pie.cluster.records import NodeLoad, NodeRecord
from pie.cluster.registry import JoinRefused, Registration
from pie.cluster.status import read_status
from pie.cluster.store import retry_delay
from pie.config import ClusterConfig, ConfigError, EngineConfig, with_overrides
from pie.server.joining import join_cluster
from tests.redis_fixtures import RedisServer, free_port, redis_server  # noqa: F401
from tests.server_fixtures import serving

STATUS_TIMEOUT = 3.0


def cluster(url: str, **keys: Any) -> ClusterConfig:
    return with_overrides(EngineConfig(), cluster={"redis": url, **keys}).cluster


async def nodes(url: str) -> dict[str, NodeRecord]:
    status = await read_status(url, STATUS_TIMEOUT, 256)
    return {node.node_id: node for node in status.nodes}


async def pie_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    command = [sys.executable, "-m", "pie.cli", *args]
    return await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)


@pytest.mark.unit
def test_the_cluster_table_refuses_what_cannot_work() -> None:
    assert EngineConfig().cluster.redis == ""
    for keys, words in [
        ({"redis": "http://127.0.0.1:6379"}, "redis://HOST:PORT"),
        ({"redis": "redis://127.0.0.1:6379/zero"}, "a database is a number"),
        ({"redis": "redis://x", "renew_seconds": 5.0}, "less than cluster.ttl_seconds"),
        ({"advertise_ws": "http://a:1"}, "ws:// or wss://"),
        ({"node_id": "no spaces"}, "node_id"),
    ]:
        with pytest.raises(ConfigError, match=words):
            with_overrides(EngineConfig(), cluster=keys)


@pytest.mark.integration
async def test_a_serving_node_shows_in_status_with_its_urls_models_and_load(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    config = cluster(redis_server.url, node_id="alpha", advertise_http="http://alpha.example:80")
    async with serving(tmp_path) as server, trio.open_nursery() as nursery:
        registration = await nursery.start(join_cluster, config, server, None)
        found = (await nodes(redis_server.url))["alpha"]
        assert found.ws_url == server.url and found.http_url == ""
        assert found.models == tuple(m.name for m in server.engine.models)
        stats = server.engine.statistics()
        assert found.load == NodeLoad(inferlets=0, free_pages=stats.kv.pages_free, queued_passes=0)
        shown = await pie_cli("cluster", "status", "--cluster", redis_server.url, "--json")
        text = await pie_cli("cluster", "status", "--cluster", redis_server.url)
        with trio.fail_after(10):
            while registration.renewals < 2:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert (document["programs"], document["snapshots"]) == ([], [])
    [node] = document["nodes"]
    assert node["node_id"] == "alpha" and node["ws_url"] == server.url
    assert node["load"]["free_pages"] == stats.kv.pages_free
    [line] = text.stdout.decode().splitlines()
    assert line.startswith(f"alpha  {server.url}  -  models={found.models[0]}  inferlets=0 ")
    assert await nodes(redis_server.url) == {}, "a node that stops cleanly leaves"


NODE_SCRIPT = textwrap.dedent(
    """
    import sys, trio
    from pie.cluster.records import NodeLoad, NodeRecord
    from pie.cluster.registry import Registration
    from pie.config import EngineConfig, with_overrides

    keys = {"redis": sys.argv[1], "ttl_seconds": 1.0, "renew_seconds": 0.2}
    config = with_overrides(EngineConfig(), cluster=keys).cluster
    node = NodeRecord(node_id=sys.argv[2], ws_url="ws://127.0.0.1:1")

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(Registration(config, node, NodeLoad).run)
            print("joined", flush=True)

    trio.run(main)
    """
)


@pytest.mark.integration
async def test_a_node_that_stops_renewing_drops_out_within_its_ttl(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    command = [sys.executable, "-c", NODE_SCRIPT, redis_server.url, "doomed"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert await trio.to_thread.run_sync(process.stdout.readline) == "joined\n"
        await trio.sleep(1.5)  # past one ttl: renewals keep it there
        assert set(await nodes(redis_server.url)) == {"doomed"}
        process.send_signal(signal.SIGKILL)  # nothing gets to leave
        killed = time.monotonic()
        with trio.fail_after(5):
            while await nodes(redis_server.url):
                await trio.sleep(0.1)
        assert time.monotonic() - killed <= 1.0 + 0.5
    finally:
        process.kill()
        process.wait()


@pytest.mark.integration
async def test_a_node_rides_out_a_redis_restart_and_registers_again(
    redis_server: RedisServer,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = cluster(redis_server.url, ttl_seconds=1.0, renew_seconds=0.1)
    registration = Registration(config, NodeRecord(node_id="n1", ws_url="ws://h:1"), NodeLoad)
    async with trio.open_nursery() as nursery:
        await nursery.start(registration.run)
        await trio.to_thread.run_sync(redis_server.stop)
        with trio.fail_after(10):
            while registration.failures < 3:
                await trio.sleep(0.05)
        await trio.to_thread.run_sync(redis_server.start)  # empty: nothing was saved
        with trio.fail_after(10):
            while "n1" not in await nodes(redis_server.url):
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    lost = [r for r in caplog.records if "lost Redis" in r.getMessage()]
    assert len(lost) == 1, "told once, not at every retry"
    assert any("is back" in r.getMessage() for r in caplog.records)


@pytest.mark.integration
async def test_a_node_id_in_use_is_refused(redis_server: RedisServer) -> None:  # noqa: F811
    config = cluster(redis_server.url)
    node = NodeRecord(node_id="same", ws_url="ws://h:1")
    async with trio.open_nursery() as nursery:
        await nursery.start(Registration(config, node, NodeLoad).run)
        with pytest.raises(ExceptionGroup) as refused:
            await nursery.start(Registration(config, node, NodeLoad).run)
        nursery.cancel_scope.cancel()
    assert refused.group_contains(JoinRefused, match="node id 'same' is in use")


@pytest.mark.integration
def test_unreachable_redis_ends_pie_serve_in_one_line_before_the_model_loads(
    tmp_path: Path,
) -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    nowhere = str(tmp_path / "no-model-here")
    command = [sys.executable, "-m", "pie.cli", "serve", "--port", "0", "--model", nowhere]
    done = subprocess.run(
        [*command, "--cluster", url], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2
    assert done.stderr == f"pie: cannot reach Redis at {url}: connection refused\n"


@pytest.mark.integration
def test_pie_cluster_status_on_an_unreachable_redis_is_one_line() -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "pie.cli", "cluster", "status", "--cluster", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        2,
        f"pie: cannot reach Redis at {url}: connection refused\n",
    )


NO_CLUSTER_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, trio
    from pie.config import EngineConfig, with_overrides
    from pie.server.main import serve

    config = with_overrides(
        EngineConfig(),
        model={"path": sys.argv[1]},
        kv={"num_pages": 16},
        server={"port": 0, "programs_dir": sys.argv[2]},
    )
    trio.run(serve, config, lambda server: os.kill(os.getpid(), signal.SIGTERM))
    print(sorted(m for m in sys.modules if m.startswith(("coredis", "pie.cluster"))))
    """
)


@pytest.mark.model
def test_a_node_without_cluster_settings_never_loads_the_redis_client(
    tmp_path: Path, default_model_dir: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", NO_CLUSTER_SCRIPT, str(default_model_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n"


@pytest.mark.model
async def test_two_pie_serve_nodes_on_one_redis_both_show_in_status(
    tmp_path: Path,
    default_model_dir: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    config = tmp_path / "pie.toml"
    config.write_text(f'[kv]\nnum_pages = 16\n[server]\nprograms_dir = "{tmp_path}/programs"\n')
    args = ["--config", str(config), "--cluster", redis_server.url]

    def start() -> LocalServer:
        return LocalServer.start(default_model_dir, args=[*args, "--http", "0"])

    first = await trio.to_thread.run_sync(start)
    try:
        second = await trio.to_thread.run_sync(start)
        try:
            shown = await pie_cli("cluster", "status", "--cluster", redis_server.url, "--json")
        finally:
            await trio.to_thread.run_sync(second.stop)
        left = await nodes(redis_server.url)
    finally:
        await trio.to_thread.run_sync(first.stop)
    assert shown.returncode == 0, shown.stderr
    listed = json.loads(shown.stdout)["nodes"]
    assert sorted(n["ws_url"] for n in listed) == sorted([first.url, second.url])
    assert all(n["http_url"].startswith("http://127.0.0.1:") for n in listed)
    assert all(n["models"] == [first.model] and n["load"]["free_pages"] > 0 for n in listed)
    assert [n.ws_url for n in left.values()] == [first.url], "the stopped node left at once"
    assert await nodes(redis_server.url) == {}


@pytest.mark.unit
def test_retries_while_redis_is_away_back_off_to_a_bound() -> None:
    delays = [retry_delay(0.25, failures, 5.0) for failures in range(8)]
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert retry_delay(8.0, 3, 5.0) == 8.0, "never sooner than the loop's own interval"
    assert with_overrides(EngineConfig(), cluster={}).cluster.reconnect_max_seconds == 5.0
