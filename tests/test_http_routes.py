"""Pages the HTTP front serves itself: they come before mounted programs, and only public ones
are served without credentials when the server requires them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from pie.drivers.tokenizer import Tokenizer
from pie.server.auth import UserStore
from pie.server.routes import Receive, Route, Scope, Send, find_route
from tests.server_fixtures import http_front


async def _who(scope: Scope, receive: Receive, send: Send, user: str | None) -> None:
    body = json.dumps({"path": scope["path"], "user": user}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


ROUTES = (
    Route(prefix="/health", handler=_who, public=True),
    Route(prefix="/dashboard", handler=_who),
    Route(prefix="/dashboard/state", handler=_who, public=True),
)


@pytest.mark.unit
def test_the_longest_matching_prefix_wins_and_prefixes_match_whole_segments() -> None:
    assert find_route(ROUTES, "/dashboard/state/x") is ROUTES[2]
    assert find_route(ROUTES, "/dashboard/other") is ROUTES[1]
    assert find_route(ROUTES, "/dashboardish") is None
    assert find_route(ROUTES, "/healthz") is None


@pytest.mark.integration
async def test_routes_come_before_mounts_and_private_ones_need_credentials(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    users = UserStore(tmp_path / "users")
    token = users.add("alice")
    assert token is not None
    alice = {"authorization": f"Bearer alice:{token}"}
    async with http_front(tokenizer, tmp_path, {}, users=users, routes=ROUTES) as (_, _, client):
        with trio.fail_after(30):
            health = await client.get("/health")
            refused = await client.get("/dashboard")
            wrong = await client.get("/dashboard", headers={"authorization": "Bearer alice:no"})
            served = await client.get("/dashboard/x", headers=alice)
            unmounted = await client.get("/elsewhere", headers=alice)
    assert health.status_code == 200 and health.json() == {"path": "/health", "user": None}
    assert refused.status_code == 401 and wrong.status_code == 401
    assert served.status_code == 200 and served.json() == {"path": "/dashboard/x", "user": "alice"}
    assert unmounted.status_code == 404
