"""Outgoing HTTP. The engine checks every connection against its operator's network policy:
a host it does not allow fails with `HostError` of kind `denied` and is never contacted.

    response = await http.get("https://api.example.com/items", headers={"accept": "json"})
    items = response.json()

Other failures: `timeout`, `too-large` (over the engine's response limit), `unreachable`,
`protocol` (a broken or endlessly redirecting server) and `invalid` (a bad URL or method).
A response with an error status is still a response: check `status` or `raise_for_status()`.
"""

from __future__ import annotations

import json as _json
from collections.abc import Mapping, Sequence
from typing import Any

from wit_world.imports import http as _http

from inferlet import _loop
from inferlet.errors import HostError, call

Headers = Mapping[str, str] | Sequence[tuple[str, str]]


def header_map(pairs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Lower-case names; a repeated header's values joined with ", "."""
    out: dict[str, str] = {}
    for name, value in pairs:
        key = name.lower()
        out[key] = f"{out[key]}, {value}" if key in out else value
    return out


class Response:
    def __init__(self, raw: Any) -> None:
        self.status: int = raw.status
        self.url: str = raw.url
        """Where the response came from, after redirects."""
        self.header_list: list[tuple[str, str]] = [(h.name, h.value) for h in raw.headers]
        self.headers = header_map(self.header_list)
        """Lower-case names; a repeated header's values joined with ", "."""
        self.body: bytes = bytes(raw.body)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 400

    def text(self, encoding: str = "utf-8") -> str:
        return self.body.decode(encoding, errors="replace")

    def json(self) -> Any:
        return _json.loads(self.body)

    def raise_for_status(self) -> Response:
        if self.status >= 400:
            raise HostError("status", f"{self.status} from {self.url}")
        return self

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.url!r}, {len(self.body)} bytes)"


async def fetch(
    url: str,
    *,
    method: str = "GET",
    headers: Headers | None = None,
    body: bytes | str | None = None,
    json: Any = None,
    timeout: float | None = None,
    max_redirects: int | None = None,
) -> Response:
    """Sends a request and waits for its response (other inferlets' passes go on meanwhile).
    `json` sends a JSON body with its content type; `timeout` is in seconds, for the whole
    exchange (the engine's limit is the most); `max_redirects=0` returns a 3xx as is."""
    pairs = list(headers.items() if isinstance(headers, Mapping) else headers or ())
    if json is not None:
        body = _json.dumps(json)
        if not any(name.lower() == "content-type" for name, _ in pairs):
            pairs.append(("content-type", "application/json"))
    data = body.encode() if isinstance(body, str) else (body or b"")
    request = _http.Request(
        method=method.upper(),
        url=url,
        headers=[_http.Header(name=k, value=v) for k, v in pairs],
        body=data,
        timeout_ms=None if timeout is None else max(1, int(timeout * 1000)),
        max_redirects=max_redirects,
    )
    pending = call(_http.fetch, request)
    await _loop.ready(pending)
    return Response(call(_http.fetched, pending))


async def get(url: str, **options: Any) -> Response:
    return await fetch(url, method="GET", **options)


async def post(url: str, **options: Any) -> Response:
    return await fetch(url, method="POST", **options)
