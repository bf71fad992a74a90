"""The dashboard's routes on the HTTP front: the page (public: it holds no data), the engine's
state as JSON and a live tail of the event log as JSON lines, both for operators only."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING

import trio

from pie.config import DashboardConfig
from pie.eventlog import Envelope
from pie.server.dashboard.state import Timeline, engine_state
from pie.server.dashboard.tail import Refusal, Tail, TailFilter, TailHub, render
from pie.server.routes import Receive, Route, Scope, Send, bearer_tokens, refuse, respond

if TYPE_CHECKING:
    from pie.engine import Engine
    from pie.server.auth import Credential, UserChecks

PREFIX = "/dashboard"
ASSETS = {
    "": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
"""The page's files by path below PREFIX, shipped in the `page` folder beside this module."""
PAGE_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
"""The page runs only its own script and talks only to this server: whatever text an event
carries can neither run as script nor send data elsewhere."""
HEARTBEAT_SECONDS = 1.0
"""A tail with nothing to send sends its status this often (and notices a revoked
credential or a stopping server)."""
MAX_BATCH = 256


class Dashboard:
    """Hears the event log and every model's passes from construction on; `routes()` go to the
    HttpFront. `users` is the server's user store when it requires authentication (None: every
    caller may read the data); `stopping()` true ends the tails (the server is going down)."""

    def __init__(
        self,
        engine: Engine,
        config: DashboardConfig,
        *,
        users: UserChecks | None = None,
        stopping: Callable[[], bool] = lambda: False,
        credential_check_seconds: float = 2.0,
    ) -> None:
        self.engine = engine
        self.config = config
        self.users = users
        self._stopping = stopping
        self._check_seconds = credential_check_seconds
        self.hub = TailHub(config)
        self.timelines = [Timeline(config.timeline_passes) for _ in engine.models]
        for stack, timeline in zip(engine.models, self.timelines, strict=True):
            stack.inference.observe_passes(timeline.observe)
        log = engine.log
        self._unlisten = log.listen(self.hub.hear) if log is not None else None
        self._state: tuple[float, bytes] | None = None
        self._state_lock = trio.Lock()
        self._render = trio.CapacityLimiter(1)
        """Tails encode their events on one worker thread at most."""
        page = resources.files(__package__).joinpath("page")
        self._assets = {path: (page / name).read_bytes() for path, (name, _) in ASSETS.items()}

    def routes(self) -> tuple[Route, ...]:
        return (
            Route(prefix=PREFIX, handler=self._page, public=True),
            Route(prefix=f"{PREFIX}/state", handler=self._state_route),
            Route(prefix=f"{PREFIX}/events", handler=self._events_route),
        )

    def close(self) -> None:
        """Stops hearing the event log and ends every tail."""
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        self.hub.close_all()

    # -- the page ------------------------------------------------------------------------------

    async def _page(self, scope: Scope, receive: Receive, send: Send, user: str | None) -> None:
        path = scope["path"].removeprefix(PREFIX).rstrip("/")
        if scope["method"] != "GET":
            await refuse(send, 405, "the dashboard takes GET", "method_not_allowed")
        elif path not in ASSETS:
            await refuse(send, 404, f"no dashboard file {scope['path']}", "not_found")
        else:
            await respond(send, 200, self._assets[path], ASSETS[path][1], PAGE_HEADERS)

    # -- the state -----------------------------------------------------------------------------

    async def _state_route(
        self, scope: Scope, receive: Receive, send: Send, user: str | None
    ) -> None:
        try:
            self._check(scope, user)
        except Refusal as refusal:
            await refuse(send, refusal.status, refusal.message, refusal.kind)
            return
        await respond(send, 200, await self._state_body(), "application/json")

    async def _state_body(self) -> bytes:
        """The state, computed at most once per `refresh_seconds` however many ask."""
        async with self._state_lock:
            kept = self._state
            if kept is None or time.monotonic() - kept[0] >= self.config.refresh_seconds:
                state = engine_state(self.engine, self.timelines, self.hub)
                body = await trio.to_thread.run_sync(_encode, state)
                kept = self._state = (time.monotonic(), body)
            return kept[1]

    # -- the tail ------------------------------------------------------------------------------

    async def _events_route(
        self, scope: Scope, receive: Receive, send: Send, user: str | None
    ) -> None:
        try:
            self._check(scope, user)
            if self._unlisten is None:
                raise Refusal(
                    404, "no_event_log", "the event log is off (event_log.enabled = false)"
                )
            filter = TailFilter.from_query(scope.get("query_string", b""))
            assert user is not None  # _check lets no one anonymous through
            tail = self.hub.open(user, filter)
        except Refusal as refusal:
            await refuse(send, refusal.status, refusal.message, refusal.kind)
            return
        try:
            await send(_start(200, "application/x-ndjson", [(b"cache-control", b"no-store")]))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_on_disconnect, receive, nursery.cancel_scope)
                await self._pump(tail, send, self._credential(scope))
                nursery.cancel_scope.cancel()
        finally:
            self.hub.close(tail)

    async def _pump(self, tail: Tail, send: Send, credential: Credential | None) -> None:
        """Sends what the tail queues, a status line with each heartbeat, until the tail is
        closed, the server stops or the caller's credential is revoked."""
        reported = -1
        next_check = time.monotonic() + self._check_seconds
        while not self._stopping() and (batch := await _next_batch(tail)) is not None:
            status = tail.dropped if not batch or tail.dropped != reported else None
            reported = tail.dropped
            body = await trio.to_thread.run_sync(render, batch, status, limiter=self._render)
            await send({"type": "http.response.body", "body": body, "more_body": True})
            if credential is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + self._check_seconds
                if not self._holds(credential):
                    break
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- who may read the data -------------------------------------------------------------------

    def _check(self, scope: Scope, user: str | None) -> None:
        if scope["method"] != "GET":
            raise Refusal(405, "method_not_allowed", f"{scope['path']} takes GET")
        if self.users is None:
            return
        if user is None or user not in self.config.operators:
            raise Refusal(
                403,
                "forbidden",
                f"user {user!r} may not read the dashboard's data: the server's operator lists "
                "the users who may in [dashboard] operators (dashboard.operators)",
            )

    def _credential(self, scope: Scope) -> Credential | None:
        """The token the caller proved (checked again while its tail is open)."""
        if self.users is None:
            return None
        for user, token in bearer_tokens(scope):
            return self.users.token_credential(user, token)
        return None

    def _holds(self, credential: Credential) -> bool:
        users = self.users
        return users is not None and users.holds(credential)


async def _next_batch(tail: Tail) -> list[Envelope] | None:
    """What the tail holds (up to MAX_BATCH), waiting up to a heartbeat for the first; None
    once the tail is closed."""
    batch: list[Envelope] = []
    with trio.move_on_after(HEARTBEAT_SECONDS):
        try:
            batch.append(await tail.receive.receive())
        except trio.EndOfChannel:
            return None
    while len(batch) < MAX_BATCH:
        try:
            batch.append(tail.receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return batch


def _encode(state: object) -> bytes:
    return json.dumps(state, separators=(",", ":")).encode()


async def _on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _start(
    status: int, content_type: str, headers: list[tuple[bytes, bytes]] | None = None
) -> dict[str, object]:
    head = [(b"content-type", content_type.encode()), *(headers or [])]
    return {"type": "http.response.start", "status": status, "headers": head}
