"""Attacks on the messaging bus: a user who parks messages nobody pulls, sends one huge message
or broadcasts to nobody is refused with its own error (or keeps nothing), and everyone else's
queues and topics go on working."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from pie.client import connect
from pie.config import EngineConfig, with_overrides
from pie.server.app import Server
from pie.server.auth import UserStore
from pie.wire import messages as msg
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import PYTEST_CACHE, Raw, precompiled, serving
from tests.server_fixtures import connect as raw_connect

pytestmark = pytest.mark.security

KIB = 1 << 10


@pytest.fixture(scope="module")
def switchboard(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return precompiled(built(GUESTS / "switchboard").read_bytes())


def small_bus() -> EngineConfig:
    """One user may park 1 MiB of messages; one message is at most 256 KiB."""
    return with_overrides(
        EngineConfig(),
        sandbox={"cache_dir": str(PYTEST_CACHE / "pie-components")},
        bus={"max_user_mb": 1, "max_message_kb": 256},
    )


async def hog(raw: Raw, most: int) -> tuple[int, msg.Failure]:
    """Pushes 64 KiB messages to fresh queues until one is refused."""
    for n in range(most):
        reply = await raw.call(msg.Push, queue=f"hoard{n}", message="x" * (64 * KIB))
        if isinstance(reply, msg.Failure):
            return n, reply
    raise AssertionError(f"{most} pushes of 64 KiB were all taken")


async def serve_jobs(server: Server, token: str, jobs: list[str]) -> tuple[str, list[str]]:
    """Alice pushes jobs that a worker inferlet of hers pulls and answers on a topic."""
    async with connect(server.url, user="alice", token=token) as alice:
        for job in [*jobs, "stop"]:
            await alice.push("alice-jobs", job)
        watch = await alice.watch("alice-done")
        worker = await alice.launch(
            "switchboard", {"mode": "work", "queue": "alice-jobs", "topic": "alice-done"}
        )
        outcome = await worker.result()
        answers = [await watch.next() for _ in jobs]
        await watch.stop()
    assert outcome.ok, outcome
    return outcome.result, [m.message for m in answers if m is not None]


async def test_a_client_filling_its_bus_quota_gets_quota_while_another_user_is_served(
    tmp_path: Path, switchboard: bytes
) -> None:
    users = UserStore(tmp_path / "users")
    tokens = {name: users.add(name) for name in ("mallory", "alice")}
    async with (
        serving(tmp_path, config=small_bus(), auth="on", users=users) as server,
        await raw_connect(server.url) as first,
        await raw_connect(server.url) as second,
    ):
        server.engine.programs.add(switchboard, "switchboard")
        bus = server.engine.bus.core
        with trio.fail_after(120):
            raws = [Raw(first), Raw(second)]
            for raw in raws:
                await raw.next()
                await raw.call(msg.Authenticate, user="mallory", token=tokens["mallory"])
            parked, refused = await hog(raws[0], 100)
            # A second connection of the same user shares the same quota.
            elsewhere = await raws[1].call(msg.Push, queue="more", message="x" * (64 * KIB))
            huge = await raws[1].call(msg.Push, queue="more", message="x" * (512 * KIB))
            for n in range(200):
                await raws[1].call(msg.Publish, topic=f"nobody{n}", message="x" * (64 * KIB))
            held = bus.statistics()
            names = bus.names()
            result, answers = await serve_jobs(server, tokens["alice"], ["wash", "dry"])
    assert 10 <= parked < 16
    assert refused.kind == "quota" and "'mallory'" in refused.message
    assert isinstance(elsewhere, msg.Failure) and elsewhere.kind == "quota"
    assert isinstance(huge, msg.Failure) and huge.kind == "too-large"
    # What was parked is bounded by the quota; broadcasts to nobody are kept nowhere.
    assert held.queued_bytes <= 1 << 20 and held.queued_messages == parked
    assert names == parked
    assert (result, answers) == ("2", ["WASH", "DRY"])


async def test_an_inferlet_filling_its_users_bus_quota_gets_quota_while_another_is_served(
    tmp_path: Path, switchboard: bytes
) -> None:
    users = UserStore(tmp_path / "users")
    tokens = {name: users.add(name) for name in ("mallory", "alice")}
    request = {"mode": "hoard", "queue": "hoard", "size": 64 * KIB, "most": 100}
    async with serving(tmp_path, config=small_bus(), auth="on", users=users) as server:
        server.engine.programs.add(switchboard, "switchboard")
        with trio.fail_after(120):
            async with connect(server.url, user="mallory", token=tokens["mallory"]) as mallory:
                outcomes = [
                    await (await mallory.launch("switchboard", request)).result() for _ in range(2)
                ]
                huge = await mallory.launch(
                    "switchboard", {**request, "queue": "big", "size": 512 * KIB}
                )
                too_large = await huge.result()
            result, answers = await serve_jobs(server, tokens["alice"], ["wash"])
            held = server.engine.statistics().bus
    reports = [json.loads(outcome.result) for outcome in outcomes]
    assert [r["kind"] for r in reports] == ["quota", "quota"]
    # The two inferlets of one user share its quota: the second parks nothing more.
    assert 10 <= reports[0]["pushed"] < 16 and reports[1]["pushed"] == 0
    assert json.loads(too_large.result) == {"pushed": 0, "kind": "too-large"}
    assert held.queued_messages == reports[0]["pushed"]
    assert (result, answers) == ("1", ["WASH"])
