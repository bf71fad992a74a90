"""What a clustered node shares through Redis besides its registration: the programs users
installed and the users themselves (and the client for placement), on one Redis client opened
for the server's life."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio
from attrs import frozen

from pie.cluster.programs import SharedPrograms
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
from pie.server.shared_users import MirroredUsers


@frozen(kw_only=True)
class SharedState:
    programs: SharedPrograms
    users: MirroredUsers
    """Loaded at open; start `users.run` to follow changes."""
    store: RedisStore
    """The client they share, for what else the server reads (placement)."""


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
        try:
            await users.load()
        except (*STORE_ERRORS, UsersFull) as exc:
            failure = exc  # raised outside the client's context (see check_reachable)
        else:
            yield SharedState(programs=programs, users=users, store=store)
    if isinstance(failure, UsersFull):
        raise ConfigError(str(failure)) from None
    if failure is not None:
        raise ClusterUnreachable(redis_down(config.redis, failure)) from None


def follow_users(shared: SharedState, server: Server, nursery: trio.Nursery) -> None:
    """Keeps `server`'s users in step with the cluster: a change read from Redis closes the
    connections it revoked at once, not at the next credential check."""
    shared.users.on_change = server.check_credentials
    nursery.start_soon(shared.users.follow)
