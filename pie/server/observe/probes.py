"""The pages an operator's tools read from the HTTP front: GET /metrics (Prometheus text),
/health (the process answers) and /ready (the engine takes work)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from attrs import frozen
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

from pie.server.observe.metrics import EngineMetrics
from pie.server.routes import Receive, Route, Scope, Send, refused_unless_get, respond

if TYPE_CHECKING:
    from pie.server.app import Server

JSON = "application/json"


@frozen(kw_only=True)
class Unready:
    """Why the engine takes no work now: `state` is "starting" or "stopping"."""

    state: str
    reason: str


Readiness = Callable[[], Unready | None]
"""Asked on every /ready: None when the engine takes work."""


def server_readiness(server: Server) -> Readiness:
    """A served engine is ready once its WebSocket server listens, until it begins to stop."""

    def check() -> Unready | None:
        if server.stopping:
            return Unready(state="stopping", reason="the server is stopping")
        if not server.port:
            return Unready(state="starting", reason="the server is not listening yet")
        return None

    return check


def probe_routes(
    metrics: EngineMetrics, readiness: Readiness, *, public_metrics: bool = False
) -> tuple[Route, ...]:
    """/metrics (behind the server's auth unless `public_metrics`), /health and /ready."""

    async def serve_metrics(scope: Scope, receive: Receive, send: Send, user: str | None) -> None:
        if await refused_unless_get(scope, send, "/metrics"):
            return
        await respond(send, 200, metrics.scrape(), CONTENT_TYPE_PLAIN_0_0_4)

    async def health(scope: Scope, receive: Receive, send: Send, user: str | None) -> None:
        if await refused_unless_get(scope, send, "/health"):
            return
        await respond(send, 200, json.dumps({"status": "ok"}).encode(), JSON)

    async def ready(scope: Scope, receive: Receive, send: Send, user: str | None) -> None:
        if await refused_unless_get(scope, send, "/ready"):
            return
        unready = readiness()
        if unready is None:
            await respond(send, 200, json.dumps({"status": "ready"}).encode(), JSON)
            return
        body = {"status": unready.state, "reason": unready.reason}
        await respond(send, 503, json.dumps(body).encode(), JSON)

    return (
        Route(prefix="/metrics", handler=serve_metrics, public=public_metrics),
        Route(prefix="/health", handler=health, public=True),
        Route(prefix="/ready", handler=ready, public=True),
    )
