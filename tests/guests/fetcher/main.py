"""Runs the HTTP requests it is given ({"requests": [{"url", "method", "headers", "body",
"timeout", "max_redirects"}], "parallel": bool}) one after another, or all at once with
`parallel`; for each, the response or the error kind."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import HostError, http


async def main(input: dict[str, Any]) -> list[dict[str, Any]]:
    requests = input["requests"]
    if input.get("parallel"):
        return list(await asyncio.gather(*(_one(r) for r in requests)))
    return [await _one(r) for r in requests]


async def _one(request: dict[str, Any]) -> dict[str, Any]:
    try:
        response = await http.fetch(
            request["url"],
            method=request.get("method", "GET"),
            headers=request.get("headers"),
            body=request.get("body"),
            timeout=request.get("timeout"),
            max_redirects=request.get("max_redirects"),
        )
    except HostError as err:
        return {"error": err.kind, "message": err.message}
    return {
        "status": response.status,
        "url": response.url,
        "headers": response.headers,
        "body": response.text(),
    }
