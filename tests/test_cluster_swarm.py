"""scenarios/swarm with its agents split over two `pie serve --cluster` nodes on the default
model: the coordinator, planner and editor on one node, the writers and the critic on the other,
cooperating over the cluster's bus, and a client on the first node watching it all."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pie.client.local import LocalServer
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.redis_fixtures import RedisServer, redis_server  # noqa: F401
from tests.test_scenarios import cache_folder, load_scenario

pytestmark = pytest.mark.model


def start_node(
    model: Path, redis: RedisServer, folder: Path, name: str, components: Path
) -> LocalServer:
    folder.mkdir()
    config = folder / "pie.toml"
    config.write_text(
        f'[server]\nprograms_dir = "{folder / "programs"}"\n'
        f'[kv]\nsnapshots_dir = "{folder / "snapshots"}"\n'
        f'[cluster]\nnode_id = "{name}"\n'
    )
    env = {**os.environ, "PIE_CACHE_DIR": str(components)}
    args = ["--config", str(config), "--cluster", redis.url]
    return LocalServer.start(model, env=env, args=args)


@pytest.fixture
def nodes(
    default_model_dir: Path,  # noqa: F811
    redis_server: RedisServer,  # noqa: F811
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
) -> Iterator[tuple[LocalServer, LocalServer]]:
    components = cache_folder(pytestconfig, tmp_path_factory, "pie-serve")
    a = start_node(default_model_dir, redis_server, tmp_path / "a", "node-a", components)
    try:
        b = start_node(default_model_dir, redis_server, tmp_path / "b", "node-b", components)
        try:
            yield a, b
        finally:
            assert b.stop(grace=60) == 0, b.log_tail()
    finally:
        assert a.stop(grace=60) == 0, a.log_tail()


def test_the_swarm_runs_with_its_agents_split_over_two_nodes(
    nodes: tuple[LocalServer, LocalServer],
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    a, b = nodes
    inferlets = cache_folder(pytestconfig, tmp_path_factory, "pie-inferlets")
    report = load_scenario("swarm").run(a.url, cache_dir=inferlets, elsewhere=b.url)
    assert all(report["checks"].values()), (report["checks"], report["error"])
    stages = [message["stage"] for message in report["watched"]]
    assert stages == ["plan", "drafts", "drafts", "drafts", "critique", "answer"]
    senders = {message["stage"]: message["sender"] for message in report["watched"]}
    assert senders["plan"].startswith("inferlet:") and "@" not in senders["plan"]
    assert senders["critique"].endswith("@node-b")
    remote = [agent["role"] for agent in report["agents"] if agent.get("remote")]
    assert remote == ["writer", "writer", "writer", "critic"]
