"""Opening a client: the WebSocket to a node, its `Welcome`, and authentication (a token, or a
challenge signed with a private key), then the client until the block ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from trio_websocket import HandshakeError, WebSocketConnection
from trio_websocket import open_websocket_url as _open_websocket_url

from pie.client.connection import CONNECT_SECONDS, DEFAULT_URL, Client
from pie.client.errors import CannotConnect, ConnectionLost, raise_sole
from pie.client.peers import Peers
from pie.wire.frames import DEFAULT_MAX_FRAME


@asynccontextmanager
async def connect(
    url: str = DEFAULT_URL,
    *,
    user: str | None = None,
    token: str | None = None,
    key: Path | str | None = None,
    key_password: str | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> AsyncIterator[Client]:
    """Opens a connection, reads the server's `Welcome` and, when `user` is given, authenticates
    (with `token`, or by signing a challenge with the private `key`; neither when auth is off).
    Raises `CannotConnect` or `AuthenticationFailed`."""
    if (token is not None or key is not None) and user is None:
        raise ValueError("a token or key needs a user")
    async with AsyncExitStack() as stack:
        ws = await _open(stack, url, max_frame)
        client = Client(ws, url, max_frame)
        options: dict[str, Any] = {"user": user, "token": token, "key": key}
        options["key_password"] = key_password
        try:
            async with trio.open_nursery() as nursery:
                await client._start(nursery)
                client._peers = Peers(
                    nursery, lambda peer: connect(peer, max_frame=max_frame, **options), url
                )
                try:
                    await client._authenticate(
                        user, token, None if key is None else Path(key), key_password
                    )
                    yield client
                finally:
                    client._lose(ConnectionLost(f"the connection to {url} was closed"))
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise_sole(group)


async def _open(stack: AsyncExitStack, url: str, max_frame: int) -> WebSocketConnection:
    opening = _open_websocket_url(url, max_message_size=max_frame, connect_timeout=CONNECT_SECONDS)
    try:
        return await stack.enter_async_context(opening)
    except HandshakeError as exc:
        raise CannotConnect(url, str(exc.__cause__ or exc) or type(exc).__name__) from None
    except (OSError, ValueError) as exc:
        raise CannotConnect(url, str(exc)) from None
