"""A node's membership of the cluster: it writes its record under a key that expires, renews it
with its current load, rides out Redis being away (with back-off, serving locally meanwhile),
and deletes it when it stops."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import trio

from pie.cluster.records import NODES_INDEX, NodeLoad, NodeRecord
from pie.cluster.status import live_nodes
from pie.cluster.store import (
    STORE_ERRORS,
    ClusterUnreachable,
    RedisStore,
    open_store,
    reason,
    redacted,
    redis_down,
    retry_delay,
)
from pie.config import ClusterConfig, ConfigError

log = logging.getLogger(__name__)


class JoinRefused(ConfigError):
    """The cluster would not take this node (its id is in use, or it is full)."""


class Registration:
    """Keeps `node` registered in the cluster of `config`, with `load()` read at each renewal."""

    def __init__(
        self,
        config: ClusterConfig,
        node: NodeRecord,
        load: Callable[[], NodeLoad],
        on_back: Callable[[], None] | None = None,
    ) -> None:
        """`on_back` is called when a renewal succeeds after failing (Redis came back, maybe
        restarted without its data)."""
        self.config = config
        self.node = node
        self.load = load
        self.on_back = on_back
        self.renewals = 0
        self.failures = 0
        """Renewals that failed in a row (0 while Redis answers)."""
        self.left = False
        """Whether the record was deleted when the node left."""
        self._renewing = trio.CancelScope()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Joins (raising ClusterUnreachable or JoinRefused), reports started, then renews until
        cancelled, when it leaves."""
        url = self.config.redis
        async with open_store(url, self.config.connect_timeout_seconds) as store:
            try:
                await self._join(store)
            except STORE_ERRORS as exc:
                raise ClusterUnreachable(redis_down(url, exc)) from None
            try:
                with self._renewing:
                    task_status.started()
                    await self._renew_forever(store)
            finally:
                await self._leave()

    def leave(self) -> None:
        """Stops renewing and deletes the record now: a node that has begun to stop takes no
        new work, so it should not be listed (nor routed to) while it finishes what it has."""
        self._renewing.cancel()

    async def _join(self, store: RedisStore) -> None:
        present = await live_nodes(store, self.config.max_nodes)
        if len(present.nodes) >= self.config.max_nodes:
            raise JoinRefused(
                f"the cluster at {redacted(store.url)} holds {len(present.nodes)} nodes, its "
                f"[cluster] max_nodes: raise it on every node to add more"
            )
        if not await store.put(self.node.key, self._record(), self.config.ttl_seconds, new=True):
            where = redacted(store.url)
            raise JoinRefused(
                f"node id {self.node.node_id!r} is in use in the cluster at {where}: give another "
                f"[cluster] node_id (a node that stopped without leaving frees its id within "
                f"ttl_seconds)"
            )
        await store.add_to_set(NODES_INDEX, self.node.node_id)

    async def _renew_forever(self, store: RedisStore) -> None:
        while True:
            await trio.sleep(self._next_delay())
            try:
                await self._renew(store)
            except STORE_ERRORS as exc:
                self._failed(store.url, exc)
            else:
                self._recovered(store.url)

    async def _renew(self, store: RedisStore) -> None:
        await store.put(self.node.key, self._record(), self.config.ttl_seconds)
        if self.failures:
            # Redis may have restarted empty: the index entry may be gone with the record.
            await store.add_to_set(NODES_INDEX, self.node.node_id)
        self.renewals += 1

    def _next_delay(self) -> float:
        config = self.config
        return retry_delay(config.renew_seconds, self.failures, config.reconnect_max_seconds)

    def _failed(self, url: str, exc: BaseException) -> None:
        if not self.failures:
            log.warning(
                "pie: lost Redis at %s (%s): node %s keeps serving locally and retries",
                redacted(url),
                reason(exc),
                self.node.node_id,
            )
        self.failures += 1

    def _recovered(self, url: str) -> None:
        if self.failures:
            where, node = redacted(url), self.node.node_id
            log.warning("pie: Redis at %s is back; node %s registered", where, node)
            if self.on_back is not None:
                self.on_back()
        self.failures = 0

    async def _leave(self) -> None:
        # A client of its own: the running one's connections are cancelled with this task.
        timeout = self.config.connect_timeout_seconds
        with trio.move_on_after(timeout, shield=True):
            try:
                async with open_store(self.config.redis, timeout) as store:
                    await store.delete(self.node.key)
                    await store.remove_from_set(NODES_INDEX, self.node.node_id)
                self.left = True
            except Exception as exc:  # noqa: BLE001 (leaving is best effort: the record expires)
                log.warning("pie: could not leave the cluster cleanly (%s)", reason(exc))

    def _record(self) -> str:
        return attrs.evolve(self.node, load=self.load(), renewed_at=time.time()).to_json()
