"""The users of a cluster in Redis: one hash of user name -> record (JSON, as the on-disk user
file holds it), written by compare-and-set, and a version stamp that changes with every write
so that nodes notice a change with one cheap read."""

from __future__ import annotations

import secrets
from typing import Any

import trio

from pie.cluster.store import RedisStore

USERS_KEY = "pie:users"
"""A hash: user name -> its record as JSON (`token_sha256`, `public_keys`)."""
USERS_VERSION_KEY = "pie:users:version"
"""A random stamp, new at every change of USERS_KEY (random, not a counter: a Redis restarted
empty that counts again from 1 could repeat a number a node has seen)."""

# KEYS: users, version. ARGV: name, the record expected ('' for none), the new record ('' to
# delete), the most users, a new version stamp.
_SWAP = """
local current = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if current ~= ARGV[2] then return 'changed' end
if ARGV[3] == '' then
  if current == '' then return 'ok' end
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  if current == '' and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then return 'full' end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
redis.call('SET', KEYS[2], ARGV[5])
return 'ok'
"""


class UsersFull(ValueError):
    """The cluster holds [cluster] max_users users already."""


class UserChanged(RuntimeError):
    """Another writer changed the user between the read and the write."""


class SharedUsers:
    """The users' records of a cluster, through `store`; every method may raise STORE_ERRORS."""

    def __init__(self, store: RedisStore, *, max_users: int) -> None:
        self.store = store
        self.max_users = max_users

    async def version(self) -> str | None:
        """The current stamp; None when no user was ever written (or Redis lost its data)."""
        with trio.fail_after(self.store.timeout):
            stamp = await self.store.client.get(USERS_VERSION_KEY)
        return None if stamp is None else _text(stamp)

    async def read(self, name: str) -> str | None:
        """`name`'s record as stored (JSON), or None."""
        with trio.fail_after(self.store.timeout):
            raw = await self.store.client.hget(USERS_KEY, name)
        return None if raw is None else _text(raw)

    async def read_all(self) -> tuple[str | None, dict[str, str]]:
        """The version stamp and every record (at most max_users are read)."""
        client = self.store.client
        with trio.fail_after(self.store.timeout):
            stamp = await client.get(USERS_VERSION_KEY)
            count = await client.hlen(USERS_KEY)
            if count > self.max_users:
                raise UsersFull(
                    f"the cluster holds {count} users, more than [cluster] max_users "
                    f"({self.max_users}): raise it on every node"
                )
            found = await client.hgetall(USERS_KEY)
        records = {_text(name): _text(raw) for name, raw in found.items()}
        return (None if stamp is None else _text(stamp)), records

    async def swap(self, name: str, expected: str | None, record: str | None) -> None:
        """Writes `record` (None: deletes) for `name` if its record is still `expected`;
        raises UserChanged otherwise, UsersFull when a new user would pass max_users."""
        args: list[Any] = [name, expected or "", record or "", self.max_users]
        args.append(secrets.token_hex(16))
        with trio.fail_after(self.store.timeout):
            outcome = _text(
                await self.store.client.eval(_SWAP, [USERS_KEY, USERS_VERSION_KEY], args)
            )
        if outcome == "changed":
            raise UserChanged(f"user {name!r} changed meanwhile")
        if outcome == "full":
            raise UsersFull(
                f"the cluster holds {self.max_users} users, its [cluster] max_users: remove one "
                "or raise it on every node"
            )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
