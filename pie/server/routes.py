"""Pages the HTTP front serves itself, ahead of any mounted program (health, metrics, the
dashboard): each a path prefix and an ASGI-style handler told who is calling."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from attrs import frozen

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send, str | None], Awaitable[None]]
"""Called with the request and the caller's user name (None on a public route without
credentials)."""


@frozen(kw_only=True)
class Route:
    prefix: str
    """Matches this path and every path below it (`/dashboard` matches `/dashboard/state`)."""
    handler: Handler
    public: bool = False
    """Served without credentials even when the server requires them (health checks)."""

    def matches(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix.rstrip("/") + "/")


def find_route(routes: Sequence[Route], path: str) -> Route | None:
    """The route with the longest prefix that matches `path`, or None."""
    found = [route for route in routes if route.matches(path)]
    return max(found, key=lambda route: len(route.prefix), default=None)


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """A whole response, never cached."""
    head = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def refuse(
    send: Send, status: int, message: str, kind: str, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """A route's refusal, in the error object the rest of the front answers with."""
    error = {"message": message, "type": kind, "param": None, "code": kind}
    await respond(send, status, json.dumps({"error": error}).encode(), "application/json", headers)


async def refused_unless_get(scope: Scope, send: Send, path: str) -> bool:
    """Answers what is not a GET of exactly `path` (404, 405); True when it did."""
    if scope["path"] != path:
        await refuse(send, 404, f"nothing is served at {scope['path']}", "not_found")
        return True
    if scope["method"] != "GET":
        message = f"{path} answers GET only"
        await refuse(send, 405, message, "method_not_allowed", [(b"allow", b"GET")])
        return True
    return False


def bearer_tokens(scope: Scope) -> Iterator[tuple[str, str]]:
    """(user, token) of each `Authorization: Bearer USER:TOKEN` header of the request."""
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            user, _, token = value[7:].decode("latin-1").strip().partition(":")
            yield user, token
