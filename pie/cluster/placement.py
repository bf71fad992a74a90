"""Where a WebSocket launch should run: on the node holding the named snapshots it names, else
on the least-loaded live node; the choice is pure, the snapshot directory is read from Redis."""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Mapping, Sequence

import trio

from pie.cluster.records import NodeLoad, NodeRecord
from pie.cluster.store import RedisStore

SNAPSHOT_PREFIX = "pie:snap:"
"""A named snapshot's entry (a hash with `node`, `pages`, ...) at SNAPSHOT_PREFIX + its id."""


def snapshot_key(model: str, user: str, name: str) -> str:
    """The directory key of `user`'s snapshot `name` of `model`."""
    digest = hashlib.sha256(f"{model}\0{user}\0{name}".encode()).hexdigest()
    return SNAPSHOT_PREFIX + digest[:32]


async def snapshot_holders(
    store: RedisStore, models: Sequence[str], user: str, names: Sequence[str]
) -> list[str]:
    """The node holding each of `user`'s snapshots `names` (of any of `models`) that the
    directory knows, in the order of `names`."""
    holders = []
    for name in names:
        for model in models:
            with trio.fail_after(store.timeout):
                node = await store.client.hget(snapshot_key(model, user, name), "node")
            if node:
                holders.append(node.decode() if isinstance(node, bytes) else str(node))
                break
    return holders


def choose_node(
    here: str,
    here_load: NodeLoad,
    nodes: Sequence[NodeRecord],
    holders: Sequence[str],
    *,
    slack: int,
    sent: Mapping[str, int] | None = None,
) -> NodeRecord | None:
    """The node a launch should go to, or None for this one (`here`).

    `nodes` are the live records; only those with a WebSocket URL are candidates. The node
    holding most of the named snapshots wins (this node on a tie); with none live, the node
    running the fewest inferlets (`sent` adds the launches already sent to a node since its
    record was written), but only when this node runs more than `slack` more than it does."""
    others = {n.node_id: n for n in nodes if n.ws_url and n.node_id != here}
    counts = collections.Counter(h for h in holders if h == here or h in others)
    if counts:
        most = max(counts.values())
        if counts[here] == most:
            return None
        return others[next(h for h in holders if counts[h] == most)]
    sent = sent or {}

    def load(node: NodeRecord) -> tuple[int, int, str]:
        inferlets = node.load.inferlets + sent.get(node.node_id, 0)
        return (inferlets, -node.load.free_pages, node.node_id)

    if not others:
        return None
    best = min(others.values(), key=load)
    return best if here_load.inferlets - load(best)[0] > slack else None
