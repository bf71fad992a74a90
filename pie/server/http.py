"""HTTP-served inferlets: an ASGI app on hypercorn's Trio worker. Each request to a mounted path
prefix runs in a fresh instance of the program mounted there (its `handle` export), batched with
everything else the engine runs; the response streams back as the instance writes it."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio
from attrs import frozen
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from pie.actors.requester import InferletRun, Requester, RequestRefused
from pie.config import HttpConfig
from pie.events import inferlet as ev
from pie.sandbox.host.serving import is_final_status
from pie.server.connections import contain_connection_failures
from pie.server.mounts import OPENAI_PREFIX, Mounts
from pie.server.routes import Route, bearer_tokens, find_route

if TYPE_CHECKING:
    from pie.engine import Engine
    from pie.server.auth import Credential, UserChecks

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

CREDENTIAL_HEADERS = frozenset({b"authorization"})
"""Where the front end takes a pie token; kept from programs whether or not auth is on (an
OpenAI client sends its key there either way)."""

MAX_ERROR_CHARS = 1000

ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
"""The OpenAI error type of a status; other 4xx are `invalid_request_error`, 5xx
`server_error`."""

END_STATUS = {"timeout": 504, "terminated": 503}
LAUNCH_REFUSED = {"too_many_inferlets": 429, "no_such_program": 404}
"""The status of a launch the engine refused, by kind (anything else: 502)."""
"""How an instance that ended before it responded is answered (anything else: 500)."""


@frozen(kw_only=True)
class HttpStatistics:
    requests: int
    in_flight: int
    failed: int
    responses: tuple[tuple[str, int], ...] = ()
    """Responses begun, by status class ("2xx", "4xx"...), in that order."""


class HttpFront:
    """Start with `await nursery.start(front.run)` (it reports itself once bound, with `port`
    set); `stop()` stops accepting and lets requests in flight finish."""

    def __init__(
        self,
        engine: Engine,
        config: HttpConfig,
        mounts: Mounts,
        *,
        host: str,
        users: UserChecks | None = None,
        credential_check_seconds: float = 2.0,
        shutdown_seconds: float = 30.0,
        routes: tuple[Route, ...] = (),
        sockets: Sequence[socket.socket] = (),
    ) -> None:
        """`sockets`: listening sockets bound beforehand (see pie.server.main.bind_ports);
        without them hypercorn binds `host` and [http] port when the front starts."""
        self.engine = engine
        self.routes = routes
        """Pages the front serves itself; they take precedence over mounted programs."""
        self.config = config
        self.mounts = mounts
        self.host = host
        self.users = users
        self.credential_check_seconds = credential_check_seconds
        self.shutdown_seconds = shutdown_seconds
        """After `stop`, how long requests in flight may go on ([server] shutdown_seconds)."""
        self.port = 0
        self._sockets = list(sockets)
        self._stopping = trio.Event()
        self._requester: Requester | None = None
        self._requests = 0
        self._in_flight = 0
        self._failed = 0
        self._responses = collections.Counter[str]()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def run(
        self, *, task_status: trio.TaskStatus[HttpFront] = trio.TASK_STATUS_IGNORED
    ) -> None:
        settings = HypercornConfig()
        host = f"[{self.host}]" if ":" in self.host else self.host
        # Hypercorn takes over a bound socket by its descriptor, which it then owns.
        settings.bind = [f"fd://{s.detach()}" for s in self._sockets] or [
            f"{host}:{self.config.port}"
        ]
        settings.accesslog = None
        settings.graceful_timeout = self.shutdown_seconds
        contain_connection_failures()
        async with self.engine.requester("http-front") as requester, trio.open_nursery() as nursery:
            self._requester = requester
            binds = await nursery.start(self._serve, settings)
            self.port = int(binds[0].rsplit(":", 1)[1])
            task_status.started(self)

    async def _serve(self, settings: HypercornConfig, *, task_status: Any) -> None:
        await serve(
            self._app,  # type: ignore[arg-type]
            settings,
            shutdown_trigger=self._stopping.wait,
            task_status=task_status,
            mode="asgi",
        )

    def stop(self) -> None:
        """Stops accepting connections; requests in flight go on."""
        self._stopping.set()

    async def wait_idle(self) -> None:
        while self._in_flight:
            await trio.sleep(0.02)

    @property
    def _body_limit(self) -> int:
        return int(self.config.max_body_mb * (1 << 20))

    def statistics(self) -> HttpStatistics:
        return HttpStatistics(
            requests=self._requests,
            in_flight=self._in_flight,
            failed=self._failed,
            responses=tuple(sorted(self._responses.items())),
        )

    # -- the ASGI app ----------------------------------------------------------------------------

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            self._requests += 1
            self._in_flight += 1
            try:
                await self._request(scope, receive, self._counted(send))
            finally:
                self._in_flight -= 1

    def _counted(self, send: Send) -> Send:
        """`send`, counting each response by its status class."""

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self._responses[f"{message['status'] // 100}xx"] += 1
            await send(message)

        return counted

    async def _request(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _ambiguous_length(scope):
            # The shape of request smuggling: two framings disagree on where the body ends, so
            # nothing after this request's head on this connection can be trusted.
            # Its body is read first (up to the limit), so that hypercorn has parsed to the end of
            # this request before the refusal asks it to close the connection.
            with contextlib.suppress(_ClientGone):
                await _read_body(receive, self._body_limit)
                message = "a request may not carry both Content-Length and Transfer-Encoding"
                await _error(send, 400, message, "bad_request", close=True)
            return
        route = find_route(self.routes, scope["path"])
        if route is not None:
            await self._route(route, scope, receive, send)
            return
        found = self.mounts.find(scope["path"])
        if found is None:
            await _error(send, 404, f"nothing is mounted at {scope['path']}", "not_found")
            return
        program, path = found
        caller = self._caller(scope)
        if caller is None:
            await _error(send, 401, "give Authorization: Bearer USER:TOKEN", "invalid_api_key")
            return
        user, credential = caller
        openai = self.config.openai and scope["path"].startswith(OPENAI_PREFIX + "/")
        limit = min(self._body_limit, self.config.openai_max_body_kb << 10 if openai else 1 << 62)
        try:
            body = await _read_body(receive, limit)
        except _ClientGone:
            return
        if body is None:
            await self._too_large(send, openai)
            return
        request = ev.IncomingRequest(
            method=scope["method"],
            path=path,
            query=scope.get("query_string", b"").decode("latin-1"),
            headers=_forwarded_headers(scope),
            body=body,
        )
        assert self._requester is not None
        try:
            run = await self._requester.launch(program, "", user=user, request=request)
        except RequestRefused as err:
            await _error(send, LAUNCH_REFUSED.get(err.kind, 502), err.message, err.kind)
            return
        await self._relay(run, receive, send, credential)

    async def _route(self, route: Route, scope: Scope, receive: Receive, send: Send) -> None:
        caller = self._caller(scope)
        if caller is None and not route.public:
            await _error(send, 401, "give Authorization: Bearer USER:TOKEN", "unauthenticated")
            return
        await route.handler(scope, receive, send, caller[0] if caller else None)

    async def _too_large(self, send: Send, openai: bool) -> None:
        if openai:
            # Refused before any tokens are counted or any instance runs, as the API does it.
            limit = f"{self.config.openai_max_body_kb} KiB"
            message = f"the request body is over {limit}: shorten the messages or the input"
            await _error(send, 400, message, "request_too_large")
        else:
            limit = f"{self.config.max_body_mb:g} MiB"
            await _error(send, 413, f"the request body is over {limit}", "too_large")

    async def _relay(
        self, run: InferletRun, receive: Receive, send: Send, credential: Credential | None
    ) -> None:
        """Streams the instance's response; a client that goes away, or whose credentials are
        revoked meanwhile, terminates the instance."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_on_disconnect, receive, run, nursery.cancel_scope)
            if credential is not None:
                nursery.start_soon(self._on_revocation, credential, run, nursery.cancel_scope)
            await self._stream(run, send)
            nursery.cancel_scope.cancel()

    async def _stream(self, run: InferletRun, send: Send) -> None:
        started = False
        async for event in run.stream():
            match event:
                case ev.ResponseStarted() if not is_final_status(event.status):
                    # The host refuses these; should one get here, it must not reach hypercorn,
                    # where a 101 would switch the connection's protocol.
                    await run.terminate()
                    self._failed += 1
                    message = f"status {event.status} is not a final HTTP status (200-599)"
                    await _error(send, 500, message, "inferlet_failed")
                    return
                case ev.ResponseStarted():
                    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in event.headers]
                    await send(
                        {"type": "http.response.start", "status": event.status, "headers": headers}
                    )
                    started = True
                case ev.ResponseBody():
                    await send(
                        {"type": "http.response.body", "body": event.chunk, "more_body": True}
                    )
                case ev.InferletReturned() | ev.InferletFailed() | ev.InferletTerminated():
                    if not isinstance(event, ev.InferletReturned):
                        self._failed += 1
                    await _end(send, event, started)

    async def _on_revocation(
        self, credential: Credential, run: InferletRun, scope: trio.CancelScope
    ) -> None:
        assert self.users is not None
        while self.users.holds(credential):
            await trio.sleep(self.credential_check_seconds)
        log.info("HTTP request of %r ended: its credentials were revoked", credential.user)
        await _terminate(run)
        scope.cancel()

    def _caller(self, scope: Scope) -> tuple[str, Credential | None] | None:
        """Who the request runs for, and the credential it proved (None without auth)."""
        if self.users is None:
            return self.config.user, None
        for user, token in bearer_tokens(scope):
            credential = self.users.token_credential(user, token) if token else None
            if credential is not None:
                return user, credential
        return None


async def _end(send: Send, end: Any, started: bool) -> None:
    if started:
        if not isinstance(end, ev.InferletReturned):
            # The head is gone already; the body just stops short.
            log.warning("an HTTP-served instance ended mid-response: %s", end)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    outcome = ev.outcome_of(end)
    status = END_STATUS.get(outcome.status, 500)
    if outcome.error:
        log.warning("an HTTP-served instance %s: %s", outcome.status, outcome.error)
    message = _public_error(outcome.error) or outcome.status
    await _error(send, status, message, f"inferlet_{outcome.status}")


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else ERROR_TYPES.get(status, "invalid_request_error")


def _public_error(error: str | None) -> str:
    """What a client may see of an instance's error: its first line (for a Python guest, the
    exception and its message), never the traceback after it, which stays in the log."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    return lines[0][:MAX_ERROR_CHARS] if lines else ""


async def _on_disconnect(receive: Receive, run: InferletRun, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    await _terminate(run)
    scope.cancel()


async def _terminate(run: InferletRun) -> None:
    try:
        await run.terminate()
    except RequestRefused:  # it ended meanwhile
        pass


class _ClientGone(Exception):
    """The client disconnected before its request was read."""


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None when it is over `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _forwarded_headers(scope: Scope) -> tuple[tuple[str, str], ...]:
    """The request's headers as the program gets them: without pie's own credentials (the
    program learns who called from `runtime.user()`, never from the token)."""
    return tuple(
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in scope["headers"]
        if name not in CREDENTIAL_HEADERS
    )


def _ambiguous_length(scope: Scope) -> bool:
    names = {name for name, _ in scope["headers"]}
    return b"transfer-encoding" in names and b"content-length" in names


async def _error(send: Send, status: int, message: str, code: str, *, close: bool = False) -> None:
    """An error in the shape the OpenAI API uses, so that its clients read every refusal: the
    type follows the status, the code is the refusal's kind."""
    error = {"message": message, "type": error_type(status), "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
