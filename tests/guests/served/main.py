"""A test guest served over HTTP: the path picks what it does."""

from __future__ import annotations

from typing import Any

from inferlet import runtime, serving
from inferlet.serving import HttpError, Request, Response


async def handle(request: Request) -> Any:
    if request.path == "/echo":
        return {
            "method": request.method,
            "path": request.path,
            "params": request.params,
            "headers": request.headers,
            "body": request.text(),
            "instance": runtime.instance_id(),
            "user": runtime.user(),
        }
    if request.path == "/stream":
        count = int(request.params.get("n", "3"))
        stream = serving.respond(200, {"content-type": "text/event-stream", "x-pieces": count})
        for n in range(count):
            stream.event({"n": n})
        stream.write("data: [DONE]\n\n")
        return None
    if request.path == "/teapot":
        raise HttpError(418, "short and stout")
    if request.path == "/bytes":
        return Response(bytes(range(256)), 201, {"content-type": "application/x-raw"})
    if request.path == "/crash":
        raise RuntimeError("handler crashed")
    if request.path == "/bad-status":
        return Response("x", status=42)
    if request.path == "/status":
        return Response(request.params.get("body", ""), status=int(request.params["code"]))
    if request.path == "/respond":
        serving.respond(int(request.params["code"]), {"content-type": "text/plain"})
        return "streamed"
    if request.path == "/wait":
        stream = serving.respond(200, {"content-type": "text/plain"})
        stream.write("waiting\n")
        from inferlet import session

        await session.receive()
        return "never"
    raise HttpError(404, f"nothing at {request.path}")
