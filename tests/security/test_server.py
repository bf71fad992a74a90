"""Attacks on the server's front doors (the HTTP front end, WebSocket sessions, auth and the
OpenAI endpoint): each one is refused with its own clear error, and a good client is served
correctly afterwards."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from pie.actors.requester import RequestRefused
from pie.client.local import LocalServer
from pie.drivers.tokenizer import Tokenizer
from pie.events import inferlet as ev
from pie.sandbox.host import session as session_host
from pie.server.auth import UserStore
from pie.server.mounts import OPENAI_PREFIX, OPENAI_SERVER
from pie.wire import messages as msg
from pie.wire.frames import DEFAULT_MAX_FRAME, encode_frame
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import PYTEST_CACHE, Raw, connect, http_front, precompiled, serving

pytestmark = pytest.mark.security


@pytest.fixture(scope="module")
def served(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "served").read_bytes()


@pytest.fixture(scope="module")
def relay(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "relay").read_bytes()


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


async def test_a_revoked_users_streaming_request_ends_and_others_are_served(
    served: bytes, tokenizer: Tokenizer, components: Path, tmp_path: Path
) -> None:
    users = UserStore(tmp_path / "users")
    alice, bob = users.add("alice"), users.add("bob")
    async with http_front(tokenizer, components, {"/s": served}, users=users) as (
        engine,
        front,
        client,
    ):
        front.credential_check_seconds = 0.05
        with trio.fail_after(60):
            headers = {"authorization": f"Bearer alice:{alice}"}
            async with client.stream("GET", "/s/wait", headers=headers) as reply:
                lines = reply.aiter_lines()
                assert await lines.__anext__() == "waiting"
                users.remove("alice")
                # The response is cut short: the client sees a body that never ended.
                with trio.fail_after(5), pytest.raises(httpx.RemoteProtocolError):
                    await lines.__anext__()
            while engine.statistics().inferlets.running:
                await trio.sleep(0.02)
            again = await client.get("/s/echo", headers=headers)
            served_bob = await client.get("/s/echo", headers={"authorization": f"Bearer bob:{bob}"})
    assert engine.statistics().inferlets.terminated == 1
    assert again.status_code == 401
    assert served_bob.status_code == 200 and served_bob.json()["user"] == "bob"


# -- WebSocket sessions -----------------------------------------------------------------------


async def test_revoking_a_user_or_replacing_a_token_closes_their_connections(
    tmp_path: Path, relay: bytes
) -> None:
    users = UserStore(tmp_path / "users")
    ada, bob = users.add("ada"), users.add("bob")
    assert ada is not None and bob is not None
    config = {"auth": "on", "users": users, "credential_check_seconds": 0.05}
    async with serving(tmp_path, **config) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with await connect(server.url) as ada_ws, await connect(server.url) as bob_ws:
                ada_raw, bob_raw = Raw(ada_ws), Raw(bob_ws)
                for raw, user, token in ((ada_raw, "ada", ada), (bob_raw, "bob", bob)):
                    await raw.next()
                    await raw.call(msg.Authenticate, user=user, token=token)
                request = json.dumps({"mode": "relay"})
                launched = await ada_raw.call(msg.Launch, program="relay", input=request)
                users.remove("ada")
                with trio.fail_after(5), pytest.raises(ConnectionClosed) as closed:
                    while True:
                        await ada_raw.next()
                listing = await bob_raw.call(msg.ListInferlets)
                # Ada's inferlet is left as any disconnected client's: running, detached.
                tracked = server.hub.tracked[launched.instance]
                assert tracked.live and not tracked.attached
                bob = users.add("bob")
                assert bob is not None
                with trio.fail_after(5), pytest.raises(ConnectionClosed) as rotated:
                    while True:
                        await bob_raw.next()
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                welcome = await raw.call(msg.Authenticate, user="bob", token=bob)
                assert isinstance(welcome, msg.Authenticated)
                assert isinstance(await raw.call(msg.ListInferlets), msg.InferletList)
    assert closed.value.reason.code == 1008 and "revoked" in (closed.value.reason.reason or "")
    assert rotated.value.reason.code == 1008
    assert isinstance(listing, msg.InferletList)


async def test_a_connection_that_never_authenticates_is_closed_after_the_login_deadline(
    tmp_path: Path,
) -> None:
    users = UserStore(tmp_path / "users")
    token = users.add("ada")
    assert token is not None
    async with serving(tmp_path, auth="on", users=users, login_seconds=0.2) as server:
        with trio.fail_after(30):
            async with await connect(server.url) as good_ws, await connect(server.url) as idle:
                good = Raw(good_ws)
                await good.next()
                await good.call(msg.Authenticate, user="ada", token=token)
                await Raw(idle).next()
                with trio.fail_after(5), pytest.raises(ConnectionClosed) as closed:
                    await idle.get_message()
                # The good client's deadline has passed too; it is served.
                listing = await good.call(msg.ListInferlets)
    assert closed.value.reason.code == 1008
    assert "not authenticated within 0.2 s" in (closed.value.reason.reason or "")
    assert isinstance(listing, msg.InferletList)


async def test_a_crashing_program_s_caller_gets_no_traceback(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    async with http_front(tokenizer, components, {"/s": served}) as (_, _, client):
        with trio.fail_after(60):
            crash = await client.get("/s/crash")
            after = await client.get("/s/echo")
    error = crash.json()["error"]
    assert crash.status_code == 500 and error["message"] == "RuntimeError: handler crashed"
    assert "Traceback" not in crash.text and "File " not in crash.text
    assert set(error) == {"message", "type", "param", "code"}
    assert after.status_code == 200


# -- the OpenAI endpoint ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_wasm(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return precompiled(built(OPENAI_SERVER).read_bytes())


def _chat(client: openai.OpenAI, model: str, content: str, **extra: Any) -> Any:
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        **extra,
    )


async def test_an_oversized_prompt_is_refused_at_once_with_an_openai_error(
    openai_wasm: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    programs = {OPENAI_PREFIX: openai_wasm}
    async with http_front(tokenizer, components, programs, openai=True) as (engine, front, raw):
        client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
        model = engine.info.model_name
        with trio.fail_after(120):
            with trio.fail_after(10), pytest.raises(openai.BadRequestError) as huge:
                await trio.to_thread.run_sync(lambda: _chat(client, model, "x" * (10 << 20)))
            launched = engine.statistics().inferlets.launched
            with pytest.raises(openai.BadRequestError) as long:
                await trio.to_thread.run_sync(lambda: _chat(client, model, "hello " * 40_000))
            good = await trio.to_thread.run_sync(lambda: _chat(client, model, "Hi"))
    assert huge.value.code == "request_too_large" and launched == 0
    assert long.value.code == "context_length_exceeded" and long.value.param == "messages"
    assert good.choices[0].message.role == "assistant" and good.usage.completion_tokens >= 1


async def test_a_prompt_the_kv_cache_can_never_hold_is_a_400_not_a_500(
    openai_wasm: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    # 64 pages of 16 tokens: an instance may hold half of them (kv.inferlet_page_share).
    programs = {OPENAI_PREFIX: openai_wasm}
    front_of = http_front(tokenizer, components, programs, openai=True, num_pages=64)
    async with front_of as (engine, front, _):
        client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
        model = engine.info.model_name
        with trio.fail_after(120):
            with pytest.raises(openai.BadRequestError) as long:
                await trio.to_thread.run_sync(lambda: _chat(client, model, "hello " * 700))
            good = await trio.to_thread.run_sync(lambda: _chat(client, model, "Hi"))
        stats = engine.statistics().kv
    assert long.value.status_code == 400 and long.value.code == "context_length_exceeded"
    assert "Traceback" not in str(long.value.body)
    assert good.choices[0].message.role == "assistant"
    assert stats.pages_free == stats.pages_total


async def test_client_errors_are_4xx_openai_errors_and_the_endpoint_serves_on(
    openai_wasm: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    programs = {OPENAI_PREFIX: openai_wasm}
    async with http_front(tokenizer, components, programs, openai=True) as (engine, _, client):
        model = engine.info.model_name
        user = {"role": "user", "content": "Hi"}
        bad_bodies = {
            "stream_options": {"messages": [user], "stream": True, "stream_options": "x"},
            "messages[0].role": {"messages": [{"role": ["user"], "content": "Hi"}]},
            "messages": {"messages": "Hi"},
        }
        with trio.fail_after(120):
            replies = {
                param: await client.post("/v1/chat/completions", json={"model": model, **body})
                for param, body in bad_bodies.items()
            }
            not_json = await client.post("/v1/chat/completions", content=b"{nope")
            unknown = await client.post("/v1/chat/completions", json={"model": "gpt-x"})
            good = await client.post(
                "/v1/chat/completions", json={"model": model, "messages": [user], "max_tokens": 2}
            )
    for param, reply in replies.items():
        assert reply.status_code == 400, (param, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param and error["type"] == "invalid_request_error"
    assert not_json.status_code == 400 and "Traceback" not in not_json.text
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["role"] == "assistant"


# -- session output -----------------------------------------------------------------------------


async def _flood(raw: Raw, **request: Any) -> list[Any]:
    """What the client receives of a `flood` run: its session messages, then its end."""
    launched = await raw.call(msg.Launch, program="relay", input=json.dumps(request))
    events = await raw.until_end(launched.instance)
    return [e.event.text or e.event.data for e in events if hasattr(e.event, "text")]


async def test_a_message_over_the_clients_frame_limit_once_encoded_is_refused_to_the_inferlet(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(120):
            # The client's own limit, as pie.client sets it.
            ws_open = open_websocket_url(server.url, max_message_size=DEFAULT_MAX_FRAME)
            async with ws_open as ws:
                raw = Raw(ws)
                await raw.next()
                controls = await _flood(raw, mode="flood", size=4 << 20, char="\x01")
                fits = await _flood(raw, mode="flood", size=1 << 20, char="\x01")
    assert controls == ["refused: too-large"]
    assert fits == ["\x01" * (1 << 20), "sent"]


def test_the_session_limit_counts_a_message_as_its_frame_holds_it() -> None:
    assert session_host.MAX_FRAME_BYTES == DEFAULT_MAX_FRAME
    for message in ("plain", '\x01\n"é😀', bytes(range(256)), b"", b"x" * 1000):
        key = "text" if isinstance(message, str) else "data"
        event = ev.SessionMessage(instance="i1", **{key: message})
        frame = encode_frame(msg.InferletEvent(instance="i1", seq=1, event=event))
        framed = frame.split(f'"{key}":', 1)[1]
        assert framed.startswith(json.dumps(message) if key == "text" else '"')
        assert session_host.encoded_size(message) <= len(framed)
    big = bytes(13 << 20)  # base64 makes it over 17 MiB
    assert session_host.encoded_size(big) > session_host.MAX_MESSAGE_BYTES


# -- shutdown -----------------------------------------------------------------------------------


async def test_sigterm_lets_an_http_response_in_flight_go_on_for_shutdown_seconds(
    tmp_path: Path,
    built: Callable[[Path], Path],  # noqa: F811
    default_model_dir: Path,  # noqa: F811
) -> None:
    grace = 8.0
    config = tmp_path / "pie.toml"
    config.write_text(
        f'[sandbox]\ncache_dir = "{PYTEST_CACHE / "pie-components"}"\n'
        f"[server]\nshutdown_seconds = {grace}\n"
    )
    mount = f"/s={built(GUESTS / 'served')}"
    args = ["--config", str(config), "--http", "0", "--mount", mount]
    server = await trio.to_thread.run_sync(lambda: LocalServer.start(default_model_dir, args=args))
    try:
        url = re.search(r"(http://\S+)/s serves", server.log_tail(50))
        assert url is not None, server.log_tail()
        with trio.fail_after(120):
            async with (
                httpx.AsyncClient(base_url=url[1], timeout=60) as client,
                client.stream("GET", "/s/wait") as reply,
            ):
                lines = reply.aiter_lines()
                assert await lines.__anext__() == "waiting"
                server.process.send_signal(signal.SIGTERM)
                signalled = trio.current_time()
                # The instance never finishes: the response is cut when the grace is over.
                with pytest.raises(httpx.RemoteProtocolError):
                    await lines.__anext__()
                lasted = trio.current_time() - signalled
            code = await trio.to_thread.run_sync(server.process.wait)
    finally:
        server.kill()
    assert grace - 0.5 <= lasted < grace + 10, lasted
    assert code == 0


async def test_removing_a_user_deletes_their_snapshots_and_frees_their_pages(
    tmp_path: Path,
) -> None:
    users = UserStore(tmp_path / "users")
    assert users.add("ada") is not None and users.add("bob") is not None
    config = {"auth": "on", "users": users, "credential_check_seconds": 0.05}
    async with serving(tmp_path, **config) as server:
        engine = server.engine
        with trio.fail_after(30):
            async with engine.requester() as r:
                for user in ("ada", "bob"):
                    context = await r.create_context(user=user)
                    await r.forward(context, list(range(40)))
                    await r.save(context, "kept", user=user)
                    await r.destroy(context)
                held = engine.statistics().kv
                users.remove("ada")
                while engine.statistics().kv.snapshots == held.snapshots:
                    await trio.sleep(0.01)
                with pytest.raises(RequestRefused) as gone:
                    await r.open("kept", user="ada")
                kept = await r.open("kept", user="bob")
                assert await r.describe(kept)
                await r.destroy(kept)
            after = engine.statistics().kv
    assert gone.value.kind == "no_such_snapshot"
    assert after.snapshots == held.snapshots - 1
    assert after.pages_free > held.pages_free


async def test_a_user_over_their_inferlet_limit_gets_429_and_is_served_once_under_it(
    served: bytes, tokenizer: Tokenizer, components: Path
) -> None:
    limit = {"max_inferlets_per_user": 1}
    front_of = http_front(tokenizer, components, {"/s": served}, sandbox=limit)
    async with front_of as (engine, _, client):
        with trio.fail_after(60):
            async with client.stream("GET", "/s/wait") as waiting:
                assert waiting.status_code == 200
                over = await client.get("/s/echo")
            # The waiting request's instance ends once its caller has gone.
            while engine.statistics().inferlets.running:
                await trio.sleep(0.01)
            under = await client.get("/s/echo")
        refused = engine.statistics().inferlets.refused
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "too_many_inferlets"
    assert "max_inferlets_per_user" in over.json()["error"]["message"]
    assert under.status_code == 200 and under.json()["path"] == "/echo"
    assert refused == 1
