"""Attacks on the server's front doors (the HTTP front end, WebSocket sessions, auth and the
OpenAI endpoint): each one is refused with its own clear error, and a good client is served
correctly afterwards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from pie.drivers.tokenizer import Tokenizer
from pie.server.auth import UserStore
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import http_front

pytestmark = pytest.mark.security


@pytest.fixture(scope="module")
def served(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "served").read_bytes()


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("components")


# -- the HTTP front end --------------------------------------------------------------------------


async def test_a_program_answering_an_interim_status_gets_its_caller_a_500(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    async with http_front(tokenizer, components, {"/s": served}) as (engine, front, client):
        with trio.fail_after(120):
            refused = {
                path: await client.get(f"/s/{path}")
                for path in (
                    "status?code=101",
                    "status?code=100",
                    "status?code=199",
                    "status?code=600",
                    "respond?code=101",
                )
            }
            after = await client.get("/s/echo")
            fine = await client.get("/s/status?code=204")
    for path, reply in refused.items():
        assert reply.status_code == 500, path
        assert "not a final HTTP status" in reply.json()["error"]["message"], path
    assert after.status_code == 200 and after.json()["path"] == "/echo"
    assert fine.status_code == 204
    assert engine.statistics().inferlets.running == 0


async def _exchange(port: int, request: bytes) -> bytes:
    """Everything the server sends on one raw connection until it closes it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        received = b""
        while chunk := await stream.receive_some(1 << 16):
            received += chunk
        return received


async def test_a_request_with_both_content_length_and_transfer_encoding_is_refused_and_closed(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    smuggled = (
        b"POST /s/echo HTTP/1.1\r\nHost: pie\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        b"GET /s/echo?smuggled=1 HTTP/1.1\r\nHost: pie\r\n\r\n"
    )
    async with http_front(tokenizer, components, {"/s": served}) as (engine, front, client):
        with trio.fail_after(60):
            answer = await _exchange(front.port, smuggled)
            after = await client.get("/s/echo?good=1")
        launched = engine.statistics().inferlets.launched
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert answer.count(b"HTTP/1.1 ") == 1 and b"smuggled" not in answer
    assert b"Content-Length and Transfer-Encoding" in answer
    assert after.status_code == 200 and after.json()["params"] == {"good": "1"}
    assert launched == 1


async def test_a_served_program_never_sees_the_callers_pie_token(
    served: bytes, tokenizer: Tokenizer, components: Path, tmp_path: Path
) -> None:
    users = UserStore(tmp_path / "users")
    token = users.add("alice")
    assert token is not None
    credentials = {"authorization": f"Bearer alice:{token}", "x-kept": "yes"}
    async with http_front(tokenizer, components, {"/s": served}, users=users) as (_, _, client):
        with trio.fail_after(60):
            echoed = await client.get("/s/echo", headers=credentials)
            refused = await client.get("/s/echo", headers={"authorization": "Bearer alice:nope"})
    assert echoed.status_code == 200
    assert token not in echoed.text and "authorization" not in echoed.json()["headers"]
    assert echoed.json()["user"] == "alice" and echoed.json()["headers"]["x-kept"] == "yes"
    assert refused.status_code == 401


async def test_without_authentication_an_authorization_header_is_still_kept_from_programs(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    async with http_front(tokenizer, components, {"/s": served}) as (_, _, client):
        with trio.fail_after(60):
            echoed = await client.get("/s/echo", headers={"authorization": "Bearer sk-secret"})
    assert echoed.status_code == 200 and "sk-secret" not in echoed.text
    assert echoed.json()["user"] == "http"
