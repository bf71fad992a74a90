"""What a clustered node shares through Redis besides its registration: the programs users
installed, the users themselves and the directory of named snapshots (and the client for
placement), on one Redis client opened for the server's life."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import trio
from attrs import frozen

from pie.cluster.programs import SharedPrograms
from pie.cluster.snapshots import SnapshotDirectory, node_secret
from pie.cluster.store import (
    STORE_ERRORS,
    ClusterUnreachable,
    RedisStore,
    open_store,
    redis_down,
)
from pie.cluster.users import SharedUsers, UsersFull
from pie.config import ClusterConfig, ConfigError
from pie.server.app import Server
from pie.server.routes import Route
from pie.server.shared_snapshots import NodeSnapshots
from pie.server.shared_users import MirroredUsers
from pie.server.snapshot_copy import copy_route

if TYPE_CHECKING:
    from pie.engine import Engine


@frozen(kw_only=True)
class SharedState:
    programs: SharedPrograms
    users: MirroredUsers
    """Loaded at open; start `users.run` to follow changes."""
    store: RedisStore
    """The client they share, for what else the server reads (placement)."""
    snapshots: SnapshotDirectory
    secret: str
    """The cluster's node secret: what a node shows to copy another's snapshot pages."""


@contextlib.asynccontextmanager
async def open_shared_state(config: ClusterConfig) -> AsyncIterator[SharedState]:
    """The cluster's programs and users, with the users read once; ClusterUnreachable when
    Redis does not answer, ConfigError when it holds more users than [cluster] max_users."""
    failure: BaseException | None = None
    async with open_store(config.redis, config.connect_timeout_seconds) as store:
        programs = SharedPrograms(
            store,
            max_program_bytes=config.max_program_mb << 20,
            max_user_bytes=config.max_user_programs_mb << 20,
        )
        shared_users = SharedUsers(store, max_users=config.max_users)
        users = MirroredUsers(shared_users, config.users_poll_seconds, config.reconnect_max_seconds)
        snapshots = SnapshotDirectory(store, max_user_entries=config.max_user_snapshots)
        try:
            await users.load()
            secret = await node_secret(store)
        except (*STORE_ERRORS, UsersFull) as exc:
            failure = exc  # raised outside the client's context (see check_reachable)
        else:
            yield SharedState(
                programs=programs, users=users, store=store, snapshots=snapshots, secret=secret
            )
    if isinstance(failure, UsersFull):
        raise ConfigError(str(failure)) from None
    if failure is not None:
        raise ClusterUnreachable(redis_down(config.redis, failure)) from None


def follow_users(shared: SharedState, server: Server, nursery: trio.Nursery) -> None:
    """Keeps `server`'s users in step with the cluster: a change read from Redis closes the
    connections it revoked at once, not at the next credential check."""
    shared.users.on_change = server.check_credentials
    nursery.start_soon(shared.users.follow)


@frozen(kw_only=True, eq=False)
class SharedNode:
    """What a clustered server adds to its HTTP front, and whom it tells that Redis is back."""

    routes: tuple[Route, ...]
    snapshots: tuple[NodeSnapshots, ...]

    def redis_back(self) -> None:
        for node in self.snapshots:
            node.redis_back()


async def share_node(
    shared: SharedState, config: ClusterConfig, server: Server, nursery: trio.Nursery
) -> SharedNode:
    """Follows the cluster's users and shares the node's named snapshots."""
    follow_users(shared, server, nursery)
    snapshots = await share_snapshots(shared, config, server.engine, nursery)
    routes = snapshot_routes(shared, config, server.engine)
    return SharedNode(routes=routes, snapshots=tuple(snapshots))


async def share_snapshots(
    shared: SharedState, config: ClusterConfig, engine: Engine, nursery: trio.Nursery
) -> list[NodeSnapshots]:
    """Puts every served model's named snapshots in the cluster's directory (those rebuilt at
    start first) and keeps it told of each change; `config.node_id` must be set."""
    assert config.node_id, "a clustered node is named before its snapshots are shared"
    nodes = []
    copies = trio.CapacityLimiter(config.snapshot_copies)
    for stack in engine.models:
        node = NodeSnapshots(
            shared.snapshots,
            config,
            engine,
            stack,
            secret=shared.secret,
            nursery=nursery,
            copies=copies,
        )
        try:
            await node.publish_all()
        except STORE_ERRORS:
            node.redis_back()  # Redis went away since the start's check: catch up later
        stack.kv.shared = node
        nodes.append(node)
    return nodes


def snapshot_routes(shared: SharedState, config: ClusterConfig, engine: Engine) -> tuple[Route]:
    """The HTTP route other nodes copy this node's snapshots through."""
    serving = trio.CapacityLimiter(config.snapshot_copies)
    return (copy_route(engine, shared.secret, config.max_snapshot_copy_mb << 20, serving),)
