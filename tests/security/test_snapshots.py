"""Named snapshots outlive a killed server: a snapshot an inferlet saved is there, with the same
tokens and the same next greedy token, for its user after `pie serve` is killed with SIGKILL and
started again on the same directories, and still invisible to another user."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.client import connect as connect_client
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import durable_config, kill_hard, served_process

pytestmark = pytest.mark.security


@pytest.fixture(scope="module")
def kv_hog(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "kv_hog").read_bytes()


async def run(client: Any, program: str, **request: Any) -> Any:
    outcome = await (await client.launch(program, request)).result()
    assert outcome.status == "returned", outcome
    return json.loads(outcome.result)


async def test_a_saved_snapshot_survives_a_killed_server_for_its_user_alone(
    tmp_path: Path,
    kv_hog: bytes,
    default_model_dir: Path,  # noqa: F811
) -> None:
    config = durable_config(tmp_path)
    async with served_process(default_model_dir, config) as server:
        with trio.fail_after(180):
            async with connect_client(server.url, user="alice") as alice:
                await alice.install(kv_hog, name="kv", version="1.0")
                saved = await run(alice, "kv@1.0", mode="keep", name="notes", tokens=40)
        assert len(saved["tokens"]) == 40 and len(saved["next"]) == 1
        await kill_hard(server)
    async with served_process(default_model_dir, config) as server:
        with trio.fail_after(180):
            async with connect_client(server.url, user="alice") as alice:
                assert await run(alice, "kv@1.0", mode="open", name="notes") == saved
            async with connect_client(server.url, user="bob") as bob:
                await bob.install(kv_hog, name="kv", version="1.0")
                hidden = await run(bob, "kv@1.0", mode="open", name="notes")
                assert hidden == {"refused": "no-such-snapshot"}
