"""What the HTTP port answers while the engine loads its model: `pie serve` binds its ports
first, and an operator's probes get an answer rather than a connection that hangs until the
front starts. /health is 200, /ready and everything else 503 with `"status": "starting"`; each
connection gets one answer and is closed."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import trio

HEAD_BYTES = 8192
"""The most of a request's head read before it is answered."""

READ_SECONDS = 5.0
"""How long a connection may take to send its request line."""

MAX_CONNECTIONS = 64
"""Connections answered at once; more are closed as they come."""

_REASON = "the engine is loading its model"


async def answer_while_starting(
    sockets: list[socket.socket],
    *,
    task_status: trio.TaskStatus[Callable[[], None]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answers connections on (copies of) the listening `sockets` until the callable it
    starts with is called; the sockets themselves stay open for the front."""
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            for sock in sockets:
                listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock.dup()))
                nursery.start_soon(_serve, listener, nursery)
            task_status.started(scope.cancel)
            await trio.sleep_forever()


async def _serve(listener: trio.SocketListener, nursery: trio.Nursery) -> None:
    open_now = [0]
    async with listener:
        while True:
            stream = await listener.accept()
            if open_now[0] >= MAX_CONNECTIONS:
                await stream.aclose()
                continue
            open_now[0] += 1
            nursery.start_soon(_answer, stream, open_now)


async def _answer(stream: trio.SocketStream, open_now: list[int]) -> None:
    """Reads the request line (what came within READ_SECONDS) and answers it once."""
    head = b""
    try:
        async with stream:
            with trio.move_on_after(READ_SECONDS):
                while b"\r\n" not in head and len(head) < HEAD_BYTES:
                    data = await stream.receive_some(HEAD_BYTES)
                    if not data:
                        break
                    head += data
            await stream.send_all(_response(head))
    except trio.BrokenResourceError:
        pass
    finally:
        open_now[0] -= 1


def _response(head: bytes) -> bytes:
    body: dict[str, Any]
    method, _, rest = head.partition(b" ")
    path = rest.partition(b" ")[0].partition(b"?")[0]
    if method == b"GET" and path == b"/health":
        status, body = "200 OK", {"status": "ok"}
    elif method == b"GET" and path == b"/ready":
        status, body = "503 Service Unavailable", {"status": "starting", "reason": _REASON}
    else:
        error = {"message": f"{_REASON}; try again shortly", "type": "unavailable"}
        status, body = "503 Service Unavailable", {"status": "starting", "error": error}
    payload = json.dumps(body).encode()
    lines = [
        f"HTTP/1.1 {status}",
        "content-type: application/json",
        f"content-length: {len(payload)}",
        "retry-after: 5",
        "connection: close",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
