"""Attacks on program names and uploads: another user's upload under a name someone launches or
a mount serves, rebinding a name to other bytes, unfinished uploads that hold memory; and
installed programs that outlive a killed server."""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.actors.inferlet.programs import ProgramError
from pie.client import ServerError
from pie.client import connect as connect_client
from pie.config import HttpConfig
from pie.server.hub import Refused
from pie.server.mounts import prepare_mounts
from pie.wire import messages as msg
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import Raw, connect, durable_config, kill_hard, served_process, serving

pytestmark = pytest.mark.security

COUNT = {"mode": "count", "n": 2}  # the relay guest sends "0", "1" and returns "counted"


@pytest.fixture(scope="module")
def relay(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "relay").read_bytes()


@pytest.fixture(scope="module")
def misbehave(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "misbehave").read_bytes()


async def counted(client: Any, program: str) -> bool:
    outcome = await (await client.launch(program, COUNT)).result()
    return outcome.status == "returned" and "counted" in outcome.result


async def test_another_users_upload_never_takes_a_name_someone_launches(
    tmp_path: Path, relay: bytes, misbehave: bytes
) -> None:
    async with serving(tmp_path) as server:
        with trio.fail_after(180):
            async with (
                connect_client(server.url, user="alice") as alice,
                connect_client(server.url, user="bob") as bob,
            ):
                mine = await alice.install(relay, name="tool", version="1.0")
                theirs = await bob.install(misbehave, name="tool", version="1.0")
                assert theirs.hash != mine.hash
                found = await alice.query_program("tool@1.0")
                assert found is not None and found.hash == mine.hash
                with pytest.raises(ServerError) as taken:
                    await alice.install(misbehave, name="tool", version="1.0")
                assert taken.value.kind == "name-taken" and "new version" in str(taken.value)
                assert await alice.install(relay, name="tool", version="1.0") == mine
                assert await counted(alice, "tool@1.0") and await counted(alice, "tool")
                # A hash names exact bytes: bob may run them, as bob, without learning names.
                by_hash = await bob.query_program(mine.hash)
                assert by_hash is not None and by_hash.name == f"program-{mine.hash[:12]}"


async def test_a_mount_keeps_serving_the_operators_program(
    tmp_path: Path, relay: bytes, misbehave: bytes
) -> None:
    operator = tmp_path / "api.wasm"
    operator.write_bytes(relay)
    digest = hashlib.sha256(relay).hexdigest()
    config = HttpConfig(mounts={"/api": str(operator), "/same": "api@0.1.0"})
    async with serving(tmp_path) as server:
        mounts = await trio.to_thread.run_sync(prepare_mounts, server.engine, config)
        with trio.fail_after(180):
            async with connect_client(server.url, user="mallory") as mallory:
                await mallory.install(misbehave, name="api", version="0.1.0")
                await mallory.install(misbehave, name="theirs", version="1.0")
            assert mounts.find("/api/x") == (digest, "/x")
            assert mounts.find("/same") == (digest, "/")
            users_name = HttpConfig(mounts={"/x": "theirs@1.0"})
            with pytest.raises(ProgramError, match="shared namespace"):
                prepare_mounts(server.engine, users_name)
            async with connect_client(server.url, user="alice") as alice:
                found = await alice.query_program("api@0.1.0")
                assert found is not None and found.hash == digest
                assert await counted(alice, "api")


async def _as(ws: Any, user: str) -> Raw:
    raw = Raw(ws)
    assert isinstance(await raw.next(), msg.Welcome)
    assert isinstance(await raw.call(msg.Authenticate, user=user), msg.Authenticated)
    return raw


async def _announce(raw: Raw, size: int, seed: str) -> Any:
    """Starts an upload of `size` bytes and leaves it unfinished."""
    digest = hashlib.sha256(seed.encode()).hexdigest()
    return await raw.call(
        msg.UploadProgram,
        name=seed,
        version="1.0",
        hash=digest,
        size=size,
        index=0,
        count=2,
        data=b"\0asm",
    )


async def test_unfinished_uploads_are_bounded_per_connection_and_per_user(
    tmp_path: Path, relay: bytes
) -> None:
    mib = 1 << 20
    limits = {"max_pending_upload_mb": 32, "max_pending_upload_mb_per_user": 48}
    async with (
        serving(tmp_path, **limits) as server,
        await connect(server.url) as ws1,
        await connect(server.url) as ws2,
    ):
        with trio.fail_after(180):
            first, second = await _as(ws1, "alice"), await _as(ws2, "alice")
            assert isinstance(await _announce(first, 30 * mib, "a1"), msg.UploadProgress)
            refused = await _announce(first, 30 * mib, "a2")
            assert refused.kind == "too-many-uploads" and "connection" in refused.message
            refused = await _announce(second, 30 * mib, "a3")
            assert refused.kind == "too-many-uploads" and "alice" in refused.message
            async with connect_client(server.url, user="bob") as bob:
                await bob.install(relay, name="relay")
                assert await counted(bob, "relay")
            await first.ws.aclose()
            while not isinstance(await _announce(second, 30 * mib, "a4"), msg.UploadProgress):
                await trio.sleep(0.02)  # until the server has seen the first connection go
            assert server.pending_uploads.held("alice") == 30 * mib


async def test_installed_programs_survive_a_killed_server(
    tmp_path: Path,
    relay: bytes,
    default_model_dir: Path,  # noqa: F811
) -> None:
    config = durable_config(tmp_path)
    async with served_process(default_model_dir, config) as server:
        with trio.fail_after(180):
            async with connect_client(server.url, user="alice") as alice:
                mine = await alice.install(relay, name="kept", version="1.0")
        await kill_hard(server)
    async with served_process(default_model_dir, config) as server:
        with trio.fail_after(180):
            async with connect_client(server.url, user="alice") as alice:
                found = await alice.query_program("kept@1.0")
                assert found is not None and found.hash == mine.hash
                assert await counted(alice, "kept@1.0")
            async with connect_client(server.url, user="bob") as bob:
                assert await bob.query_program("kept@1.0") is None


async def test_compiles_wait_their_turn_per_user_and_overall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four users' uploads (alice sends two) against max_compiles = 2 and one per user: the
    compile step (replaced by a timed stand-in that refuses the program) never runs more than
    two at once, nor two of alice's."""
    lock = threading.Lock()
    now: collections.Counter[str] = collections.Counter()
    most: collections.Counter[str] = collections.Counter()

    async with serving(tmp_path, max_compiles=2, max_compiles_per_user=1) as server:

        def stand_in(upload: Any) -> None:
            owner = upload.name.split("-")[0]
            with lock:
                now[owner] += 1
                now["all"] += 1
                most[owner] = max(most[owner], now[owner])
                most["all"] = max(most["all"], now["all"])
            time.sleep(0.3)  # the compile's own work
            with lock:
                now[owner] -= 1
                now["all"] -= 1
            raise Refused("invalid-program", "not compiled in this test")

        monkeypatch.setattr(server, "_check_and_compile", stand_in)
        outcomes: list[str] = []

        async def upload(user: str, n: int) -> None:
            async with connect_client(server.url, user=user) as client:
                try:
                    await client.install(f"{user} {n}".encode() * 100, name=f"{user}-{n}")
                except ServerError as err:
                    outcomes.append(err.kind)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for user, n in (("alice", 1), ("alice", 2), ("bob", 1), ("carol", 1)):
                    nursery.start_soon(upload, user, n)
    assert outcomes == ["invalid-program"] * 4
    assert most["alice"] == 1 and most["all"] == 2
