"""What the cluster holds, read from Redis: the live nodes (those whose record has not expired),
the installed programs and the named snapshots (those whose holder is gone marked lost)."""

from __future__ import annotations

import time
from typing import Any

import attrs
from attrs import frozen

from pie.cluster.programs import InstalledProgram, installed_programs
from pie.cluster.records import NODES_INDEX, NodeRecord, RecordError, node_key
from pie.cluster.snapshots import SnapshotDirectory, SnapshotEntry
from pie.cluster.store import STORE_ERRORS, ClusterUnreachable, RedisStore, open_store, redis_down


@frozen(kw_only=True)
class ListedSnapshot:
    entry: SnapshotEntry
    lost: bool
    """Its holder is no longer a live node: nobody can open it."""

    def to_dict(self) -> dict[str, Any]:
        e = self.entry
        return {
            "model": e.model,
            "user": e.user,
            "name": e.name,
            "node": e.node,
            "pages": e.pages,
            "tokens": e.tokens,
            "saved_at": e.saved_at,
            "lost": self.lost,
        }

    def line(self) -> str:
        e = self.entry
        lost = "  LOST (its node is gone)" if self.lost else ""
        where = f"model={e.model}  node={e.node}  pages={e.pages}"
        return f"snapshot  {e.user}  {e.name}  {where}{lost}"


@frozen(kw_only=True)
class ClusterStatus:
    nodes: tuple[NodeRecord, ...]
    unreadable: tuple[str, ...] = ()
    """Ids whose record is not one pie wrote (left out of `nodes`)."""
    truncated: bool = False
    """More nodes are listed than `max_nodes`; only that many were read."""
    programs: tuple[InstalledProgram, ...] = ()
    """Every user's installed programs (up to LISTED_PROGRAMS)."""
    programs_truncated: bool = False
    snapshots: tuple[ListedSnapshot, ...] = ()
    """The directory's named snapshots (up to LISTED_SNAPSHOTS)."""
    snapshots_truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [node.to_dict() for node in self.nodes],
            "programs": [attrs.asdict(program) for program in self.programs],
            "programs_truncated": self.programs_truncated,
            "snapshots": [listed.to_dict() for listed in self.snapshots],
            "snapshots_truncated": self.snapshots_truncated,
            "unreadable": list(self.unreadable),
            "truncated": self.truncated,
        }

    def lines(self, now: float | None = None) -> list[str]:
        """One line per node, for people."""
        now = time.time() if now is None else now
        programs = [
            f"program  {p.user}  {p.name}@{p.version}  {p.hash[:12]}  {p.size} bytes"
            for p in self.programs
        ]
        snapshots = [listed.line() for listed in self.snapshots]
        return [_line(node, now) for node in self.nodes] + programs + snapshots


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
            status = await live_nodes(store, limit)
            programs, more = await installed_programs(store)
            snapshots, many = await _snapshots(store, status)
            return attrs.evolve(
                status,
                programs=programs,
                programs_truncated=more,
                snapshots=snapshots,
                snapshots_truncated=many,
            )
        except STORE_ERRORS as exc:
            failure = exc
    assert failure is not None
    raise ClusterUnreachable(redis_down(url, failure)) from None


async def _snapshots(
    store: RedisStore, status: ClusterStatus
) -> tuple[tuple[ListedSnapshot, ...], bool]:
    """The directory's entries, each marked lost when its node's record has expired (read for
    each node named, so a node left out of a truncated listing is not taken for lost)."""
    entries, more = await SnapshotDirectory(store, max_user_entries=1).listed()
    live = {node.node_id for node in status.nodes} | set(status.unreadable)
    unknown = sorted({e.node for e in entries} - live)
    records = await store.get_many([node_key(n) for n in unknown])
    live |= {n for n, record in zip(unknown, records, strict=True) if record is not None}
    return tuple(ListedSnapshot(entry=e, lost=e.node not in live) for e in entries), more
