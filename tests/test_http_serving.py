"""HTTP-served inferlets through the hypercorn front end, on the synthetic driver: the request
reaches `handle` below its mount prefix, responses come back whole or streamed, failures become
clear HTTP errors, a client that goes away stops its instance, and every request runs in a fresh
instance."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.config import ConfigError, config_from_dict
from pie.drivers.tokenizer import Tokenizer
from pie.server.auth import UserStore
from pie.server.mounts import Mounts
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import http_front


@pytest.fixture(scope="module")
def served(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "served").read_bytes()


@pytest.fixture(scope="module")
def social(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "social").read_bytes()


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Compiled components, shared by this module's engines (a compile takes seconds)."""
    return tmp_path_factory.mktemp("components")


@pytest.mark.integration
async def test_a_request_reaches_handle_below_its_prefix(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    async with http_front(tokenizer, components, {"/api": served}) as (_, _, client):
        with trio.fail_after(60):
            reply = await client.post(
                "/api/echo?x=1&y=two", content=b"hello body", headers={"X-Custom": "yes"}
            )
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/json"
    echo = reply.json()
    assert echo["method"] == "POST" and echo["path"] == "/echo"
    assert echo["params"] == {"x": "1", "y": "two"}
    assert echo["headers"]["x-custom"] == "yes" and echo["body"] == "hello body"
    assert echo["user"] == "http"


@pytest.mark.integration
async def test_the_longest_prefix_wins_and_unmounted_paths_are_404(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    programs = {"/": served, "/deep/er": served}
    async with http_front(tokenizer, components, programs) as (_, _, client):
        with trio.fail_after(60):
            root = (await client.get("/echo")).json()
            deep = (await client.get("/deep/er/echo")).json()
            sideways = await client.get("/deep/erx/echo")
    assert root["path"] == "/echo" and deep["path"] == "/echo"
    assert sideways.status_code == 404  # "/" serves it, and the guest has nothing there
    assert "/deep/erx/echo" in sideways.json()["error"]["message"]
    assert Mounts({"/a": "p"}).find("/b") is None
    assert Mounts({"/a": "p"}).find("/a") == ("p", "/")


@pytest.mark.integration
async def test_a_streamed_response_arrives_piece_by_piece(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    async with http_front(tokenizer, components, {"/s": served}) as (_, _, client):
        with trio.fail_after(60):
            async with client.stream("GET", "/s/stream?n=5") as reply:
                lines = [line async for line in reply.aiter_lines() if line]
    assert reply.status_code == 200 and reply.headers["x-pieces"] == "5"
    assert reply.headers["content-type"] == "text/event-stream"
    assert lines == [*(f'data: {{"n": {n}}}' for n in range(5)), "data: [DONE]"]


@pytest.mark.integration
async def test_errors_become_http_errors_and_the_engine_serves_on(
    served: bytes, social: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    programs = {"/s": served, "/plain": social}
    async with http_front(tokenizer, components, programs) as (engine, _, client):
        with trio.fail_after(120):
            teapot = await client.get("/s/teapot")
            crash = await client.get("/s/crash")
            bad_status = await client.get("/s/bad-status")
            plain = await client.get("/plain/anything")
            raw = await client.get("/s/bytes")
            after = await client.get("/s/echo")
        stats = engine.statistics().inferlets
    assert teapot.status_code == 418 and teapot.json()["error"]["message"] == "short and stout"
    assert crash.status_code == 500 and "RuntimeError: handler crashed" in crash.text
    assert bad_status.status_code == 500 and "not a final HTTP status" in bad_status.text
    assert plain.status_code == 500 and "exports no `handle`" in plain.text
    assert raw.status_code == 201 and raw.content == bytes(range(256))
    assert after.status_code == 200
    assert stats.failed == 3 and stats.running == 0


@pytest.mark.integration
async def test_a_body_over_the_limit_is_refused(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    async with http_front(tokenizer, components, {"/s": served}, max_body_mb=0.001) as (e, _, c):
        with trio.fail_after(60):
            reply = await c.post("/s/echo", content=b"x" * 2000)
        assert e.statistics().inferlets.launched == 0
    error = reply.json()["error"]
    assert reply.status_code == 413 and error["code"] == "too_large"
    assert error["type"] == "invalid_request_error"


@pytest.mark.integration
async def test_a_client_that_goes_away_stops_its_instance(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    async with http_front(tokenizer, components, {"/s": served}) as (engine, front, client):
        with trio.fail_after(60):
            async with client.stream("GET", "/s/wait") as reply:
                first = await reply.aiter_lines().__anext__()
                assert engine.statistics().inferlets.running == 1
            while engine.statistics().inferlets.running or front.statistics().in_flight:
                await trio.sleep(0.02)
        stats = engine.statistics().inferlets
    assert first == "waiting"
    assert stats.terminated == 1


@pytest.mark.integration
async def test_each_request_runs_in_a_fresh_instance(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    async with http_front(tokenizer, components, {"/s": served}) as (engine, front, client):
        replies: list[Any] = []

        async def one(n: int) -> None:
            replies.append(await client.get(f"/s/echo?n={n}"))

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for n in range(8):
                    nursery.start_soon(one, n)
        assert front.statistics().requests == 8
    echoes = [r.json() for r in replies]
    assert sorted(int(e["params"]["n"]) for e in echoes) == list(range(8))
    assert len({e["instance"] for e in echoes}) == 8


@pytest.mark.integration
async def test_with_authentication_a_bearer_token_names_the_user(
    served: bytes, tokenizer: Tokenizer, components: Path, tmp_path: Path
) -> None:
    users = UserStore(tmp_path / "users")
    token = users.add("alice")
    assert token is not None
    async with http_front(tokenizer, components, {"/s": served}, users=users) as (_, _, client):
        with trio.fail_after(60):
            anonymous = await client.get("/s/echo")
            wrong = await client.get("/s/echo", headers={"authorization": "Bearer alice:nope"})
            alice = await client.get("/s/echo", headers={"authorization": f"Bearer alice:{token}"})
    assert anonymous.status_code == 401 and wrong.status_code == 401
    assert alice.status_code == 200 and alice.json()["user"] == "alice"


@pytest.mark.unit
def test_http_config_is_checked() -> None:
    config = config_from_dict({"http": {"port": 0, "mounts": {"/v2": "api@1.0"}}})
    assert config.http.mounts == {"/v2": "api@1.0"}
    for bad in ({"v2": "x"}, {"/v2/": "x"}, {"/v2": ""}):
        with pytest.raises(ConfigError, match="http.mounts"):
            config_from_dict({"http": {"mounts": bad}})


@pytest.mark.unit
def test_the_entry_decides_the_world(tmp_path: Path) -> None:
    from pie.build import BuildError, check_inferlet

    folder = tmp_path / "both"
    folder.mkdir()
    (folder / "main.py").write_text(
        "async def main(i):\n    pass\nasync def handle(r):\n    pass\n"
    )
    with pytest.raises(BuildError, match="not both"):
        check_inferlet(folder)
    (folder / "main.py").write_text("def handle(r):\n    pass\n")
    with pytest.raises(BuildError, match="async def handle"):
        check_inferlet(folder)
    (folder / "main.py").write_text("async def handle(r):\n    pass\n")
    assert check_inferlet(folder) == "handle"
