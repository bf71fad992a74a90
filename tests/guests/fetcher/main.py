"""Runs the HTTP requests it is given ({"requests": [{"url", "method", "headers", "body",
"timeout", "max_redirects"}]}) one after another; for each, the response or the error kind."""

from __future__ import annotations

from typing import Any

from inferlet import HostError, http


async def main(input: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    for request in input["requests"]:
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
            results.append({"error": err.kind, "message": err.message})
        else:
            results.append(
                {
                    "status": response.status,
                    "url": response.url,
                    "headers": response.headers,
                    "body": response.text(),
                }
            )
    return results
