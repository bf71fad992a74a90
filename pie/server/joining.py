"""This node's entry in the cluster: its advertised URLs, its models and its load read from the
engine's statistics, kept registered by pie/cluster while the server runs."""

from __future__ import annotations

import secrets
import socket
import sys
import time
from collections.abc import Callable

import trio

from pie.cluster.records import NodeLoad, NodeRecord
from pie.cluster.registry import Registration
from pie.cluster.store import redacted
from pie.config import ClusterConfig
from pie.engine import Engine
from pie.server.app import Server
from pie.server.http import HttpFront

WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def node_load(engine: Engine) -> NodeLoad:
    stats = engine.statistics()
    return NodeLoad(
        inferlets=stats.inferlets.running + stats.inferlets.queued,
        free_pages=sum(m.kv.pages_free for m in stats.models),
        queued_passes=sum(m.scheduler.pending for m in stats.models),
    )


def advertised(url: str, host: str) -> str:
    """`url` with a wildcard bind address replaced by this machine's name, which others can
    reach where they could not reach 0.0.0.0."""
    if host not in WILDCARD_HOSTS:
        return url
    scheme, _, rest = url.partition("://")
    port = rest.rpartition(":")[2]
    return f"{scheme}://{socket.gethostname()}:{port}"


def this_node(config: ClusterConfig, server: Server, front: HttpFront | None) -> NodeRecord:
    http = ""
    if front is not None:
        http = config.advertise_http or advertised(front.url, front.host)
    return NodeRecord(
        node_id=config.node_id or f"node-{secrets.token_hex(4)}",
        ws_url=config.advertise_ws or advertised(server.url, server.config.host),
        http_url=http,
        models=tuple(m.name for m in server.engine.models),
        started_at=time.time(),
    )


async def join_cluster(
    config: ClusterConfig,
    server: Server,
    front: HttpFront | None,
    on_back: Callable[[], None] | None = None,
    *,
    task_status: trio.TaskStatus[Registration] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Registers this node and keeps it registered until cancelled or told to leave (then it
    deletes its record); `on_back` is called when Redis answers again after failing."""
    node = this_node(config, server, front)
    registration = Registration(config, node, lambda: node_load(server.engine), on_back)
    where = redacted(config.redis)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(registration.run)
            print(f"pie: joined the cluster at {where} as {node.node_id}", file=sys.stderr)
            task_status.started(registration)
    finally:
        if registration.left:
            print(f"pie: left the cluster at {where} as {node.node_id}", file=sys.stderr)
