"""What the cluster holds, read from Redis: the live nodes (those whose record has not expired),
and, in later parts, the installed programs and the named snapshots."""

from __future__ import annotations

import time
from typing import Any

from attrs import frozen

from pie.cluster.records import NODES_INDEX, NodeRecord, RecordError, node_key
from pie.cluster.store import STORE_ERRORS, ClusterUnreachable, RedisStore, open_store, redis_down


@frozen(kw_only=True)
class ClusterStatus:
    nodes: tuple[NodeRecord, ...]
    unreadable: tuple[str, ...] = ()
    """Ids whose record is not one pie wrote (left out of `nodes`)."""
    truncated: bool = False
    """More nodes are listed than `max_nodes`; only that many were read."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [node.to_dict() for node in self.nodes],
            "programs": [],
            "snapshots": [],
            "unreadable": list(self.unreadable),
            "truncated": self.truncated,
        }

    def lines(self, now: float | None = None) -> list[str]:
        """One line per node, for people."""
        now = time.time() if now is None else now
        return [_line(node, now) for node in self.nodes]


def _line(node: NodeRecord, now: float) -> str:
    load = node.load
    return (
        f"{node.node_id}  {node.ws_url}  {node.http_url or '-'}  "
        f"models={','.join(node.models) or '-'}  inferlets={load.inferlets} "
        f"free_pages={load.free_pages} queued_passes={load.queued_passes}  "
        f"renewed {max(0.0, now - node.renewed_at):.1f}s ago"
    )


async def live_nodes(store: RedisStore, limit: int) -> ClusterStatus:
    """The nodes whose record is still there, up to `limit`; ids whose record expired are
    dropped from the index on the way (the expiry, not the index, says who is alive)."""
    ids = await store.members(NODES_INDEX, limit + 1)
    truncated = len(ids) > limit
    ids = ids[:limit]
    values = await store.get_many([node_key(i) for i in ids])
    expired = [i for i, value in zip(ids, values, strict=True) if value is None]
    await store.remove_from_set(NODES_INDEX, *expired)
    nodes, unreadable = [], []
    for node_id, value in zip(ids, values, strict=True):
        if value is None:
            continue
        try:
            nodes.append(NodeRecord.from_json(value))
        except RecordError:
            unreadable.append(node_id)
    return ClusterStatus(nodes=tuple(nodes), unreadable=tuple(unreadable), truncated=truncated)


async def read_status(url: str, timeout: float, limit: int) -> ClusterStatus:
    """The status of the cluster at `url`; ClusterUnreachable when Redis does not answer."""
    failure: BaseException | None = None
    async with open_store(url, timeout) as store:
        try:
            return await live_nodes(store, limit)
        except STORE_ERRORS as exc:
            failure = exc
    assert failure is not None
    raise ClusterUnreachable(redis_down(url, failure)) from None
