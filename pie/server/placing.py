"""A clustered node's side of placement: which node a client's launch goes to, which node runs
an inferlet named by its cluster-wide id (`ID@NODE`), read from Redis at the request."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence

from pie.cluster.placement import choose_node, snapshot_holders
from pie.cluster.records import NodeRecord, RecordError, node_key
from pie.cluster.status import live_nodes
from pie.cluster.store import STORE_ERRORS, RedisStore, reason, redacted
from pie.config import ClusterConfig
from pie.engine import Engine
from pie.server.hub import Refused
from pie.server.joining import node_load
from pie.wire import messages as msg

log = logging.getLogger(__name__)

SEPARATOR = "@"
"""Between the engine's instance id and the node's id: `i3@node-3f2a9c01`."""


def node_of(instance: str) -> str | None:
    """The node a cluster-wide instance id names, or None for a plain one."""
    engine_id, sep, node = instance.rpartition(SEPARATOR)
    return node if sep and engine_id else None


class Placer:
    """Answers, for this node (`config.node_id`), where launches and inferlets belong."""

    def __init__(self, store: RedisStore, config: ClusterConfig, engine: Engine) -> None:
        assert config.node_id, "a clustered node is named before its server starts"
        self.store = store
        self.config = config
        self.engine = engine
        self.node_id = config.node_id
        self.redirected = 0
        """Launches this node sent to another."""
        self._sent: collections.deque[tuple[float, str]] = collections.deque()
        """(monotonic time, node id) of each launch sent to another node lately."""

    def cluster_id(self, engine_id: str) -> str:
        return f"{engine_id}{SEPARATOR}{self.node_id}"

    async def place(self, user: str, snapshots: Sequence[str]) -> NodeRecord | None:
        """The node a launch of `user` naming `snapshots` should run on, None for this one
        (also when policy says so or Redis does not answer: this node can always run it)."""
        limit = self.config.placement_max_snapshots
        if len(snapshots) > limit:
            raise Refused(
                "bad-frame",
                f"a launch names {len(snapshots)} snapshots; [cluster] placement_max_snapshots "
                f"is {limit}",
            )
        if self.config.placement == "local":
            return None
        try:
            status = await live_nodes(self.store, self.config.max_nodes)
            models = [model.name for model in self.engine.models]
            holders = await snapshot_holders(self.store, models, user, snapshots)
        except STORE_ERRORS as exc:
            log.warning(
                "pie: launching here: cannot read the cluster for placement (%s)", reason(exc)
            )
            return None
        target = choose_node(
            self.node_id,
            node_load(self.engine),
            status.nodes,
            holders,
            slack=self.config.placement_slack,
            sent=self._sent_lately(),
        )
        if target is not None:
            self._count_sent(target)
        return target

    async def redirect(self, corr: int, instance: str) -> msg.Redirect | None:
        """Where to send a request about `instance` when another node runs it, else None."""
        node = await self.locate(instance)
        if node is None:
            return None
        return msg.Redirect(corr=corr, node=node.node_id, url=node.ws_url)

    async def locate(self, instance: str) -> NodeRecord | None:
        """The live node running `instance`, None when it is this node's or not a cluster id;
        Refused when its node has left the cluster."""
        node = node_of(instance)
        if node is None or node == self.node_id:
            return None
        try:
            (value,) = await self.store.get_many([node_key(node)])
        except STORE_ERRORS as exc:
            where = redacted(self.store.url)
            raise Refused(
                "cluster-unavailable",
                f"cannot find node {node} of inferlet {instance}: Redis at {where}: {reason(exc)}",
            ) from None
        record = _record(value)
        if record is None or not record.ws_url:
            raise Refused(
                "node-lost",
                f"inferlet {instance} ran on node {node}, which is no longer in the cluster "
                "(it stopped or was lost, and its inferlets with it)",
            )
        return record

    def _sent_lately(self) -> dict[str, int]:
        """Launches sent to each node within two renewals, which its record may not count yet:
        records are rewritten every renew_seconds, and the launches in between would otherwise
        all pick the node that looked idle. Counting one twice for a while only errs towards
        staying here."""
        since = time.monotonic() - 2 * self.config.renew_seconds
        while self._sent and self._sent[0][0] < since:
            self._sent.popleft()
        return collections.Counter(node for _, node in self._sent)

    def _count_sent(self, target: NodeRecord) -> None:
        self._sent.append((time.monotonic(), target.node_id))
        self.redirected += 1


def _record(value: bytes | None) -> NodeRecord | None:
    if value is None:
        return None
    try:
        return NodeRecord.from_json(value)
    except RecordError:
        return None
