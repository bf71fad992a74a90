"""The OpenAI-compatible endpoint's refusals, read through the `openai` package: every error is
`{"error": {"message", "type", "param", "code"}}` with the type its status calls for, the field at
fault as `param` and a stable `code`, whether the `openai-server` inferlet or the HTTP front end
refuses; and a good request is served afterwards. One engine, on the synthetic driver, with
authentication on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from pie.drivers.tokenizer import Tokenizer
from pie.server.auth import UserStore
from pie.server.http import error_type
from pie.server.mounts import OPENAI_PREFIX, OPENAI_SERVER
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.server_fixtures import PYTEST_CACHE, http_front, precompiled

ERROR_FIELDS = {"message", "type", "param", "code"}
HI = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def openai_wasm(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return precompiled(built(OPENAI_SERVER).read_bytes())


async def refused(request: Callable[[], Any], kind: type[openai.APIStatusError]) -> Any:
    """The error the request was refused with, checked to be of `kind` and in the API's shape."""
    with pytest.raises(kind) as caught:
        await trio.to_thread.run_sync(request)
    assert isinstance(caught.value.body, dict) and set(caught.value.body) == ERROR_FIELDS
    return caught.value


def fields(error: openai.APIStatusError) -> tuple[int, Any, Any, Any]:
    return error.status_code, error.type, error.param, error.code


def answered(reply: httpx.Response) -> tuple[int, Any, Any]:
    """A raw reply's status, error type and code, checked to be in the API's shape."""
    error = reply.json()["error"]
    assert set(error) == ERROR_FIELDS, error
    return reply.status_code, error["type"], error["code"]


@pytest.mark.integration
async def test_every_refusal_is_an_openai_error_and_the_endpoint_serves_on(
    openai_wasm: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    users = UserStore(tmp_path / "users")
    token = users.add("alice")
    auth = {"authorization": f"Bearer alice:{token}"}
    programs = {OPENAI_PREFIX: openai_wasm}
    components = PYTEST_CACHE / "pie-components"
    async with http_front(tokenizer, components, programs, users=users, openai=True) as served:
        engine, front, raw = served
        url = f"{front.url}{OPENAI_PREFIX}"
        api = openai.OpenAI(base_url=url, api_key=f"alice:{token}", max_retries=0, timeout=60)
        stranger = openai.OpenAI(base_url=url, api_key="no-token", max_retries=0, timeout=60)
        model = engine.info.model_name

        def chat(client: openai.OpenAI = api, **given: Any) -> Callable[[], Any]:
            request = {"model": model, "messages": [HI], "max_tokens": 2, **given}
            return lambda: client.chat.completions.create(**request)

        part = [{"type": "text", "text": "Hi"}, {"type": "file", "file": {}}]
        with trio.fail_after(120):
            hot = await refused(chat(temperature=7), openai.BadRequestError)
            odd_part = await refused(
                chat(messages=[{"role": "user", "content": part}]), openai.BadRequestError
            )
            stored = await refused(chat(store=True), openai.BadRequestError)
            unknown = await refused(chat(model="gpt-nothing"), openai.NotFoundError)
            anonymous = await refused(chat(stranger), openai.AuthenticationError)
            not_json = await raw.post("/v1/chat/completions", content=b"{nope", headers=auth)
            no_route = await raw.get("/v1/embeddingz", headers=auth)
            unmounted = await raw.get("/v2/models", headers=auth)
            good = await trio.to_thread.run_sync(chat())
    assert fields(hot) == (400, "invalid_request_error", "temperature", "invalid_value")
    assert fields(odd_part) == (
        400,
        "invalid_request_error",
        "messages[0].content[1]",
        "invalid_value",
    )
    assert fields(stored) == (400, "invalid_request_error", "store", "unsupported_parameter")
    assert fields(unknown) == (404, "not_found_error", "model", "model_not_found")
    assert fields(anonymous) == (401, "authentication_error", None, "invalid_api_key")
    assert answered(not_json) == (400, "invalid_request_error", "invalid_json")
    assert answered(no_route) == (404, "not_found_error", "unknown_url")
    assert answered(unmounted) == (404, "not_found_error", "not_found")
    assert good.choices[0].message.role == "assistant" and good.usage.completion_tokens >= 1


@pytest.mark.unit
def test_the_error_type_follows_the_status() -> None:
    statuses = (400, 401, 403, 404, 413, 429, 500, 502, 503, 504)
    assert [error_type(status) for status in statuses] == [
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "invalid_request_error",
        "rate_limit_error",
        *["server_error"] * 4,
    ]
