"""The one place pie talks to Redis (through coredis): opening a client, checking that Redis
answers, and the few commands the node registry uses, with failures told in one line."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import coredis
import trio
from coredis.exceptions import RedisError

from pie.config import ConfigError

STORE_ERRORS = (RedisError, OSError, trio.TooSlowError)
"""What a Redis command may raise when Redis is down, slow or refuses it."""


class ClusterUnreachable(ConfigError):
    """Redis did not answer at start; the message names the URL and why."""


def redis_down(url: str, exc: BaseException) -> str:
    """`cannot reach Redis at URL: REASON`, in the words of the deepest cause."""
    return f"cannot reach Redis at {redacted(url)}: {reason(exc)}"


def redacted(url: str) -> str:
    """`url` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=user + host))


def reason(exc: BaseException) -> str:
    """Why a Redis command failed: the underlying socket error when there is one."""
    if isinstance(exc, trio.TooSlowError):
        return "no answer in time"
    deepest = exc
    while deepest.__cause__ is not None:
        deepest = deepest.__cause__
    if isinstance(deepest, socket.gaierror) and deepest.strerror:
        return deepest.strerror
    if isinstance(deepest, OSError) and deepest.errno and deepest.errno > 0:
        return os.strerror(deepest.errno).lower()
    return str(exc) or type(exc).__name__


def retry_delay(interval: float, failures: int, cap: float) -> float:
    """How long a loop that runs every `interval` waits after `failures` failed tries in a row:
    the interval, doubled at each failure, at most `cap` (or the interval, if longer)."""
    if failures <= 0:
        return interval
    return min(interval * 2.0 ** min(failures, 32), max(interval, cap))


class RedisStore:
    """An open coredis client with a deadline on every command."""

    def __init__(self, client: Any, url: str, timeout: float) -> None:
        self.client = client
        self.url = url
        self.timeout = timeout

    async def ping(self) -> None:
        with trio.fail_after(self.timeout):
            await self.client.ping()

    async def put(self, key: str, value: str, ttl_seconds: float, *, new: bool = False) -> bool:
        """Writes `value` at `key`, expiring after `ttl_seconds`; with `new`, only where no
        value is (False then, when one was)."""
        condition = coredis.PureToken.NX if new else None
        with trio.fail_after(self.timeout):
            written = await self.client.set(
                key, value, px=max(1, int(ttl_seconds * 1000)), condition=condition
            )
        return bool(written)

    async def delete(self, *keys: str) -> None:
        with trio.fail_after(self.timeout):
            await self.client.delete(list(keys))

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        with trio.fail_after(self.timeout):
            return list(await self.client.mget(keys))

    async def add_to_set(self, key: str, member: str) -> None:
        with trio.fail_after(self.timeout):
            await self.client.sadd(key, [member])

    async def remove_from_set(self, key: str, *members: str) -> None:
        if members:
            with trio.fail_after(self.timeout):
                await self.client.srem(key, list(members))

    async def members(self, key: str, limit: int) -> list[str]:
        """Up to `limit` members of the set at `key`, sorted."""
        with trio.fail_after(self.timeout):
            found = await self.client.srandmember(key, limit)
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in found)


@contextlib.asynccontextmanager
async def open_store(url: str, timeout: float) -> AsyncIterator[RedisStore]:
    """A store on the Redis at `url`; connections are made as commands need them (and made
    again after Redis comes back)."""
    client = coredis.Redis.from_url(url, connect_timeout=timeout, stream_timeout=timeout)
    async with client:
        yield RedisStore(client, url, timeout)


async def check_reachable(url: str, timeout: float) -> None:
    """Returns once Redis at `url` answers a PING; raises ClusterUnreachable otherwise."""
    failure: BaseException | None = None
    async with open_store(url, timeout) as store:
        try:
            await store.ping()
        except STORE_ERRORS as exc:
            # Raised outside the client's context, which would wrap it in an exception group.
            failure = exc
    if failure is not None:
        raise ClusterUnreachable(redis_down(url, failure)) from None
