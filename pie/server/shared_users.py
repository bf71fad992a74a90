"""A clustered node's users: a copy of the cluster's user records in memory, read again from
Redis whenever its version stamp changes (polled every users_poll_seconds), so that checks
never wait on Redis and a revocation reaches every node's open connections within a poll.
Also the `pie auth --cluster` actions, which write the records by compare-and-set."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import trio

from pie.cluster.store import STORE_ERRORS, reason, redacted, retry_delay
from pie.cluster.users import SharedUsers, UserChanged, UsersFull
from pie.server.auth import UserChecks, UserRecord, parse_record, updated_record
from pie.wire.challenge import AuthError

log = logging.getLogger(__name__)

SWAP_TRIES = 5
"""Writes retried when another writer changed the same user in between."""


class MirroredUsers(UserChecks):
    """The cluster's users as last read from Redis. Call `load`, then run `follow` in a
    nursery; `on_change` is called after each read that changed something (the server closes
    revoked connections then)."""

    def __init__(
        self, shared: SharedUsers, poll_seconds: float = 0.25, reconnect_max_seconds: float = 5.0
    ) -> None:
        self.shared = shared
        self.poll_seconds = poll_seconds
        self.reconnect_max_seconds = reconnect_max_seconds
        self.failures = 0
        """Polls that failed in a row: the next waits longer (up to reconnect_max_seconds)."""
        self.records: dict[str, dict[str, Any]] = {}
        self.version: str | None = None
        self.on_change: Callable[[], None] | None = None
        self.redis_away = False

    def _read(self, name: str) -> dict[str, Any] | None:
        return self.records.get(name)

    def names(self) -> set[str]:
        return set(self.records)

    async def load(self) -> None:
        """Reads every record afresh (at start, and when the stamp changed)."""
        version, raw = await self.shared.read_all()
        records = {}
        for name, text in raw.items():
            try:
                records[name] = parse_record(name, text, f"{name!r} in the cluster")
            except AuthError as err:
                log.warning("pie: %s: the user is left out (counts as revoked)", err)
        self.records, self.version = records, version

    async def follow(self) -> None:
        """Reads the users again whenever they changed, until cancelled (after `load`)."""
        while True:
            await trio.sleep(
                retry_delay(self.poll_seconds, self.failures, self.reconnect_max_seconds)
            )
            try:
                await self._follow()
            except STORE_ERRORS as exc:
                self.failures += 1
                self._lost(exc)
            except UsersFull as err:
                # Too many to read: keep the copy (and say so) rather than stop the server.
                self._lost(err)
            else:
                self._back()

    async def _follow(self) -> None:
        version = await self.shared.version()
        # No stamp while records are held: Redis lost its data (restarted empty). Keep the
        # copy rather than revoke everyone; the next write brings a new stamp.
        if version == self.version or (version is None and self.records):
            return
        await self.load()
        if self.on_change is not None:
            self.on_change()

    def _lost(self, exc: BaseException) -> None:
        if not self.redis_away:
            log.warning(
                "pie: cannot read the users from Redis at %s (%s): checking against the users "
                "as last read; user changes wait for Redis",
                redacted(self.shared.store.url),
                reason(exc),
            )
        self.redis_away = True

    def _back(self) -> None:
        self.failures = 0
        if self.redis_away:
            log.warning(
                "pie: read the users from Redis at %s again", redacted(self.shared.store.url)
            )
        self.redis_away = False


async def add_user(
    shared: SharedUsers, name: str, *, token: bool, public_key: str | None
) -> str | None:
    """Creates or updates `name` in the cluster; returns the new token, or None."""
    for _ in range(SWAP_TRIES):
        before = await shared.read(name)
        current = None if before is None else parse_record(name, before, f"{name!r}")
        record, new_token = updated_record(name, current, token=token, public_key=public_key)
        try:
            await shared.swap(name, before, json.dumps(record, sort_keys=True))
        except UserChanged:
            continue
        except UsersFull as err:
            raise AuthError(str(err)) from None
        return new_token
    raise AuthError(f"user {name!r} kept changing while being written: try again")


async def remove_user(shared: SharedUsers, name: str) -> None:
    """Deletes `name` from the cluster; AuthError when there is none by that name."""
    for _ in range(SWAP_TRIES):
        before = await shared.read(name)
        if before is None:
            raise AuthError(f"no user {name!r} in the cluster at {redacted(shared.store.url)}")
        try:
            await shared.swap(name, before, None)
        except UserChanged:
            continue
        return
    raise AuthError(f"user {name!r} kept changing while being removed: try again")


async def list_users(shared: SharedUsers) -> list[UserRecord]:
    """Every user of the cluster, sorted by name."""
    users = MirroredUsers(shared)
    await users.load()
    return users.list()
