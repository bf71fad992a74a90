"""`pie cluster up`: a whole cluster on this machine (pie/cluster/local.py) until Ctrl-C or
SIGTERM; its URLs on stdout, what befalls its parts on stderr, one line each."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pie.cluster.local import LocalCluster

WATCH_SECONDS = 0.25
REDIS_RESTART_SECONDS = 10.0
"""A Redis that exits again this soon after being started again is not started a third time."""


def run_cluster_up(args: argparse.Namespace) -> int:
    from pie.cluster.local import LocalCluster, LocalClusterSettings
    from pie.config import default_cache_dir

    if args.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {args.nodes}")
    settings = LocalClusterSettings(
        state_dir=Path(args.state_dir) if args.state_dir else default_cache_dir() / "cluster",
        nodes=args.nodes,
        redis=args.cluster or "",
        router_port=args.router_port,
        policy=args.policy,
        models=tuple(args.model),
        config=args.config,
        env=dict(os.environ),
    )
    signal.signal(signal.SIGTERM, _interrupt)
    nodes = f"{args.nodes} node{'s' if args.nodes > 1 else ''}"
    redis = "Redis" if not args.cluster else "no Redis (using --cluster)"
    _say(f"starting {redis}, {nodes} and the router (state in {settings.state_dir})")
    cluster = LocalCluster.start(settings)
    try:
        _announce(cluster, args.json)
        return _watch(cluster)
    except KeyboardInterrupt:
        return 0
    finally:
        # Stopping is bounded (each part is killed past its grace): a second signal waits.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _say("stopping the router, the nodes, then Redis")
        cluster.stop()
        _say("cluster stopped")


def _interrupt(number: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _say(line: str) -> None:
    print(f"pie: {line}", file=sys.stderr, flush=True)


def _announce(cluster: LocalCluster, as_json: bool) -> None:
    urls = cluster.urls()
    if as_json:
        print(json.dumps(urls), flush=True)
    else:
        kept = f"  (append-only file in {urls['redis_dir']})" if urls["redis_dir"] else ""
        print(f"redis   {urls['redis']}{kept}")
        for node in urls["nodes"]:
            print(f"node    {node['node_id']}  {node['ws_url']}  {node['http_url']}")
        print(f"router  {urls['router']}  ({urls['policy']})", flush=True)
    _say("cluster up; Ctrl-C stops it")


def _watch(cluster: LocalCluster) -> int:
    """Until a signal: tells of each part that exits; a node's exit takes it out of the router
    and the rest go on; Redis (when started here) is started again; the router's exit, or the
    last node's, ends the cluster (exit code 1)."""
    told: set[str] = set()
    restarted = -REDIS_RESTART_SECONDS  # the first exit is always met with a restart
    while True:
        time.sleep(WATCH_SECONDS)
        ended = cluster.exited()
        if "router" in ended:
            _say(f"the router exited with {ended['router']}; stopping the cluster")
            return 1
        if "redis" in ended:
            if not _restart_redis(cluster, ended["redis"], time.monotonic() - restarted):
                return 1
            restarted = time.monotonic()
        for node in cluster.nodes:
            if node.node_id in ended and node.node_id not in told:
                told.add(node.node_id)
                cluster.forget_node(node)
                _say(f"{node.node_id} exited with {ended[node.node_id]}; the router dropped it")
        if len(told) == len(cluster.nodes):
            _say("every node has exited; stopping the cluster")
            return 1


def _restart_redis(cluster: LocalCluster, code: int, ran: float) -> bool:
    from pie.cluster.redis_process import RedisProcessError

    if ran < REDIS_RESTART_SECONDS:
        _say(
            f"redis-server exited with {code} again, {ran:.0f} s after it was started again; "
            "stopping the cluster"
        )
        return False
    _say(
        f"redis-server exited with {code}; starting it again (its append-only file keeps its data)"
    )
    try:
        cluster.restart_redis()
    except RedisProcessError as err:
        _say(f"{err}; stopping the cluster")
        return False
    _say(f"Redis is back at {cluster.redis_url}")
    return True
