"""Clustered nodes for tests: a server on the synthetic driver that shares programs through a
real Redis, places launches and is registered in the cluster, in this process or in a child
process that a test can kill with SIGKILL."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from pie.config import EngineConfig, with_overrides
from pie.server.app import Server
from pie.server.clustered import open_shared_state
from pie.server.joining import join_cluster
from pie.server.placing import Placer
from tests.server_fixtures import serving

ROOT = Path(__file__).resolve().parents[1]
FAST = {"ttl_seconds": 1.0, "renew_seconds": 0.2}
"""Records renewed often and expiring soon, so tests see load and departures quickly."""


@contextlib.asynccontextmanager
async def placed_node(tmp_path: Path, url: str, name: str, **keys: Any) -> AsyncIterator[Server]:
    """A node called `name` in the cluster at `url` (its own Redis client, programs folder and
    registration, as a separate process would have); `keys` override [cluster] keys."""
    settings = {"redis": url, "node_id": name, **FAST, **keys}
    cluster = with_overrides(EngineConfig(), cluster=settings).cluster
    folder = tmp_path / name
    folder.mkdir()
    async with open_shared_state(cluster) as shared:

        def placer(engine: Any) -> Placer:
            return Placer(shared.store, cluster, engine)

        async with (
            serving(folder, shared_programs=shared.programs, placer=placer) as server,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(join_cluster, cluster, server, None)
            yield server
            nursery.cancel_scope.cancel()


NODE_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import trio
from pathlib import Path
from tests.cluster_nodes import placed_node

async def main():
    async with placed_node(Path(sys.argv[4]), sys.argv[2], sys.argv[3]) as server:
        print(server.url, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


class NodeProcess:
    """`placed_node` in a child process; `url` once it serves."""

    def __init__(self, redis_url: str, name: str, folder: Path) -> None:
        command = [sys.executable, "-c", NODE_SCRIPT, str(ROOT), redis_url, name, str(folder)]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().strip()
        assert self.url.startswith("ws://"), f"node {name} did not start"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
