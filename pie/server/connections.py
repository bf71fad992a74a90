"""Keeps a failure of one HTTP connection inside that connection. Hypercorn's Trio server runs
each connection as a task of the server's own nursery, so an exception that escapes one stops the
whole front, and `pie serve` with it: its HTTP/2 code lets two tasks write to one socket when a
client closes a cleartext HTTP/2 connection early (trio.BusyResourceError), which the SGLang
router's probe for gRPC workers does to every node it registers."""

from __future__ import annotations

import logging

import hypercorn.trio.run
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger(__name__)


class _ContainedConnection(TCPServer):
    async def run(self) -> None:
        try:
            await super().run()
        except Exception as error:
            # Cancellation is a BaseException and goes on; the connection is closed by now.
            log.warning("an HTTP connection failed and was dropped: %s", _first(error))


def _first(error: BaseException) -> str:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"


def contain_connection_failures() -> None:
    """Makes hypercorn's Trio server run each connection in `_ContainedConnection` (idempotent).
    Checked by tests/test_http_connections.py against the pinned hypercorn."""
    hypercorn.trio.run.TCPServer = _ContainedConnection  # type: ignore[misc]
