"""HTTP-served inferlets: write `async def handle(request)` in main.py instead of `main`, and
`pie serve --http PORT --mount /prefix=program` runs one instance of it per request.

    async def handle(request: Request) -> Response | str | bytes | dict | list | None:
        stream = serving.respond(200, {"content-type": "text/event-stream"})
        stream.event({"token": "hi"})      # `data: {"token": "hi"}` and a blank line

Return a `Response`, text (text/plain), bytes (application/octet-stream) or anything JSON
(application/json); after `respond`, what `handle` returns is the stream's last piece.
"""

from __future__ import annotations

import json as _json
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from wit_world.imports import http as _http
from wit_world.imports import serving as _serving

from inferlet.errors import HostError, call
from inferlet.http import Headers, header_map


class Request:
    """The request being handled. `path` is below the prefix the inferlet is mounted at."""

    def __init__(self, raw: Any) -> None:
        self.method: str = raw.method
        self.path: str = raw.path
        self.query: str = raw.query
        self.header_list: list[tuple[str, str]] = [(h.name, h.value) for h in raw.headers]
        self.headers = header_map(self.header_list)
        """Lower-case names; a repeated header's values joined with ", "."""
        self.body: bytes = bytes(raw.body)

    @property
    def params(self) -> dict[str, str]:
        """The query string's parameters (the last value of a repeated one)."""
        return dict(urllib.parse.parse_qsl(self.query, keep_blank_values=True))

    def text(self, encoding: str = "utf-8") -> str:
        return self.body.decode(encoding, errors="replace")

    def json(self) -> Any:
        """The body as JSON; a body that is not JSON raises HttpError(400)."""
        try:
            return _json.loads(self.body)
        except ValueError as err:
            raise HttpError(400, f"the body is not JSON: {err}") from None

    def __repr__(self) -> str:
        return f"Request({self.method} {self.path!r}, {len(self.body)} bytes)"


class Response:
    def __init__(self, body: bytes | str = b"", status: int = 200, headers: Headers = ()):
        self.status = status
        self.headers = _pairs(headers)
        self.body = body.encode() if isinstance(body, str) else bytes(body)

    @classmethod
    def json(cls, value: Any, status: int = 200, headers: Headers = ()) -> Response:
        pairs = [("content-type", "application/json"), *_pairs(headers)]
        return cls(_json.dumps(value), status, pairs)

    @classmethod
    def text(cls, text: str, status: int = 200, headers: Headers = ()) -> Response:
        return cls(text, status, [("content-type", "text/plain; charset=utf-8"), *_pairs(headers)])


class HttpError(Exception):
    """Raise it from `handle` to answer `status` with a JSON error body (before `respond`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Stream:
    """A response whose body goes to the client piece by piece."""

    def write(self, data: bytes | str) -> None:
        chunk = data.encode() if isinstance(data, str) else bytes(data)
        if chunk:
            call(_serving.write, chunk)

    def event(self, data: Any, event: str | None = None) -> None:
        """One server-sent event: `data` that is not a str is sent as JSON."""
        text = data if isinstance(data, str) else _json.dumps(data)
        head = f"event: {event}\n" if event else ""
        lines = "".join(f"data: {line}\n" for line in text.split("\n"))
        self.write(f"{head}{lines}\n")


_state = {"streamed": False}


def respond(status: int = 200, headers: Headers = ()) -> Stream:
    """Sends the status and headers now; the body follows through the returned stream."""
    call(_serving.respond, status, _wit_headers(_pairs(headers)))
    _state["streamed"] = True
    return Stream()


def streamed() -> bool:
    """Whether `respond` has sent the head of this instance's response."""
    return _state["streamed"]


def to_outgoing(result: Any, streamed: bool) -> Any:
    """What `handle` returned, as the export's outgoing-response."""
    if isinstance(result, Response):
        response = result
    elif result is None:
        response = Response(status=200 if streamed else 204)
    elif isinstance(result, str):
        response = Response.text(result)
    elif isinstance(result, bytes | bytearray):
        response = Response(bytes(result), headers=[("content-type", "application/octet-stream")])
    else:
        response = Response.json(result)
    return _serving.OutgoingResponse(
        status=response.status, headers=_wit_headers(response.headers), body=response.body
    )


def http_error(exc: HttpError, streamed: bool) -> Any:
    """An HttpError as its status with a JSON error body."""
    if streamed:
        raise HostError("invalid", f"HttpError({exc.status}) after the response started")
    body = {"error": {"message": exc.message, "type": "http_error"}}
    return to_outgoing(Response.json(body, exc.status), False)


def _pairs(headers: Headers) -> list[tuple[str, str]]:
    items = headers.items() if isinstance(headers, Mapping) else headers
    return [(str(k), str(v)) for k, v in items]


def _wit_headers(pairs: Sequence[tuple[str, str]]) -> list[Any]:
    return [_http.Header(name=k, value=v) for k, v in pairs]
