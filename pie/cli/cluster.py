"""`pie cluster status`: the nodes joined through one Redis, one line each or as JSON."""

from __future__ import annotations

import argparse
import json
import sys

import trio

from pie.config import ClusterConfig
from pie.config.cluster_section import redis_url_problem


def run_cluster_status(args: argparse.Namespace) -> int:
    from pie.cluster.status import read_status
    from pie.cluster.store import redacted

    problem = redis_url_problem(args.cluster)
    if problem is not None:
        raise ValueError(problem.replace("cluster.redis", "--cluster"))
    defaults = ClusterConfig()
    status = trio.run(
        read_status, args.cluster, defaults.connect_timeout_seconds, defaults.max_nodes
    )
    if args.json:
        print(json.dumps(status.to_dict(), indent=2))
        return 0
    for line in status.lines():
        print(line)
    if not status.nodes:
        print(f"pie: no nodes have joined the cluster at {redacted(args.cluster)}", file=sys.stderr)
    if status.truncated:
        print(f"pie: more than {defaults.max_nodes} nodes; only those are shown", file=sys.stderr)
    return 0
