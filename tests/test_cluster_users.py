"""Users shared by the nodes of a cluster through a real Redis: a user added with
`pie auth --cluster` connects to every node; removing it or replacing its token closes its
connections on every node within a second while other users are served; a node keeps checking
against the users it last read while Redis is away, and keeps them when Redis comes back
empty; user changes need Redis and say so in one line."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import ConnectionClosed

from pie.client import connect
from pie.client.errors import AuthenticationFailed
from pie.client.local import LocalServer
from pie.cluster.store import open_store
from pie.cluster.users import SharedUsers
from pie.config import EngineConfig, with_overrides
from pie.server.app import Server
from pie.server.clustered import follow_users, open_shared_state
from pie.server.shared_users import add_user as add_to_cluster
from pie.server.shared_users import remove_user as remove_from_cluster
from pie.wire import messages as msg
from pie.wire.challenge import AuthError
from tests.model_fixtures import default_model_dir  # noqa: F401
from tests.redis_fixtures import RedisServer, free_port, redis_server  # noqa: F401
from tests.server_fixtures import Raw, serving
from tests.server_fixtures import connect as open_ws

REVOKED_WITHIN = 1.0


@contextlib.asynccontextmanager
async def node(tmp_path: Path, url: str, name: str, **keys: Any) -> AsyncIterator[Server]:
    """A server on the synthetic driver with authentication on, its users those of the cluster
    at `url` (through its own Redis client, as a separate process would have)."""
    cluster = with_overrides(EngineConfig(), cluster={"redis": url, **keys}).cluster
    folder = tmp_path / name
    folder.mkdir()
    async with open_shared_state(cluster) as shared:
        async with (
            serving(
                folder, auth="on", users=shared.users, shared_programs=shared.programs
            ) as server,
            trio.open_nursery() as nursery,
        ):
            follow_users(shared, server, nursery)
            yield server
            nursery.cancel_scope.cancel()


async def pie_auth(url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    command = [sys.executable, "-m", "pie.cli", "auth", *args, "--cluster", url]
    return await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)


async def add_user(url: str, name: str) -> str:
    done = await pie_auth(url, "add", name)
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().strip()


async def signed_in(stack: contextlib.AsyncExitStack, url: str, user: str, token: str) -> Raw:
    """A raw connection signed in as `user`, closed with `stack`."""
    raw = Raw(await stack.enter_async_context(await open_ws(url)))
    assert isinstance(await raw.next(), msg.Welcome)
    reply = await raw.call(msg.Authenticate, user=user, token=token)
    assert isinstance(reply, msg.Authenticated), reply
    return raw


async def until_served(url: str, user: str, token: str) -> None:
    """Connects as `user` once the node has read it (within a poll or two)."""
    with trio.fail_after(5):
        while True:
            try:
                async with connect(url, user=user, token=token) as client:
                    await client.statistics()
                    return
            except AuthenticationFailed:
                await trio.sleep(0.05)


@pytest.mark.integration
async def test_a_user_added_to_the_cluster_connects_to_every_node(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    async with node(tmp_path, url, "a") as a, node(tmp_path, url, "b") as b:
        token = await add_user(url, "ada")
        for server in (a, b):
            await until_served(server.url, "ada", token)
        with pytest.raises(AuthenticationFailed):
            async with connect(b.url, user="ada", token=token + "x"):
                pass
        listed = await pie_auth(url, "list")
    assert listed.returncode == 0
    assert listed.stdout.decode().splitlines()[1].split() == ["ada", "yes", "-"]


@pytest.mark.integration
async def test_a_revocation_closes_the_users_connections_on_every_node_within_a_second(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    async with (
        node(tmp_path, url, "a") as a,
        node(tmp_path, url, "b") as b,
        contextlib.AsyncExitStack() as stack,
    ):
        ada, bob = await add_user(url, "ada"), await add_user(url, "bob")
        await until_served(b.url, "bob", bob)
        await until_served(a.url, "ada", ada)
        on_a = await signed_in(stack, a.url, "ada", ada)
        on_b = await signed_in(stack, b.url, "ada", ada)
        good = await signed_in(stack, b.url, "bob", bob)
        removed = await pie_auth(url, "remove", "ada")
        assert removed.returncode == 0, removed.stderr
        for raw in (on_b, on_a):
            with trio.fail_after(REVOKED_WITHIN):
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        await raw.next()
            assert closed.value.reason.code == 1008
            assert closed.value.reason.reason == "the credentials of 'ada' were revoked"
        assert isinstance(await good.call(msg.QueryStatistics), msg.EngineStatus)
        with pytest.raises(AuthenticationFailed):
            async with connect(b.url, user="ada", token=ada):
                pass


@pytest.mark.integration
async def test_a_new_token_revokes_the_old_one_on_every_node(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    async with node(tmp_path, url, "a") as a, contextlib.AsyncExitStack() as stack:
        old = await add_user(url, "ada")
        await until_served(a.url, "ada", old)
        held = await signed_in(stack, a.url, "ada", old)
        new = await add_user(url, "ada")
        with trio.fail_after(REVOKED_WITHIN), pytest.raises(ConnectionClosed):
            while True:
                await held.next()
        await until_served(a.url, "ada", new)


@pytest.mark.integration
async def test_with_redis_away_a_node_checks_against_the_users_it_last_read(
    tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    async with node(tmp_path, url, "a", connect_timeout_seconds=1.0) as a:
        ada = await add_user(url, "ada")
        await until_served(a.url, "ada", ada)
        redis_server.stop()
        await trio.sleep(0.6)  # a few polls fail
        async with connect(a.url, user="ada", token=ada) as client:
            await client.statistics()
        refused = await pie_auth(url, "add", "bob")
        assert refused.returncode == 2
        [line] = refused.stderr.decode().splitlines()
        assert line == f"pie auth: cannot reach Redis at {url}: connection refused"
        redis_server.start()  # back, empty: nothing was saved
        await trio.sleep(0.6)
        async with connect(a.url, user="ada", token=ada) as client:
            await client.statistics()
        bob = await add_user(url, "bob")
        await until_served(a.url, "bob", bob)
        with pytest.raises(AuthenticationFailed):
            async with connect(a.url, user="ada", token=ada):
                pass


@pytest.mark.integration
def test_pie_auth_on_an_unreachable_cluster_is_one_line() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    done = subprocess.run(
        [sys.executable, "-m", "pie.cli", "auth", "list", "--cluster", url],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == f"pie auth: cannot reach Redis at {url}: connection refused\n"


@pytest.mark.integration
async def test_the_cluster_refuses_a_user_past_max_users(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    async with open_store(redis_server.url, 3.0) as store:
        shared = SharedUsers(store, max_users=1)
        await add_to_cluster(shared, "ada", token=True, public_key=None)
        with pytest.raises(AuthError, match=r"holds 1 users, its \[cluster\] max_users"):
            await add_to_cluster(shared, "bob", token=True, public_key=None)
        assert await add_to_cluster(shared, "ada", token=True, public_key=None), "a new token"
        await remove_from_cluster(shared, "ada")
        await add_to_cluster(shared, "bob", token=True, public_key=None)
        with pytest.raises(AuthError, match="no user 'ada' in the cluster"):
            await remove_from_cluster(shared, "ada")


@pytest.mark.model
async def test_on_pie_serve_nodes_a_revocation_closes_the_users_connection_on_the_other_node(
    tmp_path: Path,
    default_model_dir: Path,  # noqa: F811
    redis_server: RedisServer,  # noqa: F811
) -> None:
    url = redis_server.url
    started = []
    for name in ("a", "b"):
        config = tmp_path / f"{name}.toml"
        config.write_text(f'[kv]\nnum_pages = 16\n[server]\nprograms_dir = "{tmp_path / name}"\n')
        args = ["--config", str(config), "--cluster", url, "--auth", "on"]
        started.append(
            await trio.to_thread.run_sync(
                lambda a=args: LocalServer.start(default_model_dir, args=a)
            )
        )
    a, b = started
    try:
        async with contextlib.AsyncExitStack() as stack:
            ada, bob = await add_user(url, "ada"), await add_user(url, "bob")
            await until_served(a.url, "ada", ada)
            await until_served(b.url, "bob", bob)
            held = await signed_in(stack, b.url, "ada", ada)
            good = await signed_in(stack, b.url, "bob", bob)
            removed = await pie_auth(url, "remove", "ada")
            assert removed.returncode == 0, removed.stderr
            with trio.fail_after(REVOKED_WITHIN), pytest.raises(ConnectionClosed):
                while True:
                    await held.next()
            assert isinstance(await good.call(msg.QueryStatistics), msg.EngineStatus)
    finally:
        for server in started:
            await trio.to_thread.run_sync(server.stop)
