"""How a client follows a cluster's redirects: a launch placed on another node, a request about
an inferlet another node runs; and the extra connections that takes, at most one per node,
each held open by a task of the client's own and closed with it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import trio

from pie.client.errors import CannotConnect, PieError
from pie.wire import messages as msg

if TYPE_CHECKING:
    from pie.client.connection import Client
    from pie.client.inferlet import RemoteInferlet

Opener = Callable[[str], AbstractAsyncContextManager[Any]]
"""`connect` with the client's own credentials, for a URL."""


class Peers:
    def __init__(self, nursery: trio.Nursery, opener: Opener, origin: str) -> None:
        self._nursery = nursery
        self._opener = opener
        self._origin = origin
        self._open: dict[str, Client] = {}
        self._opening = trio.Lock()

    async def get(self, redirect: msg.Redirect) -> Client:
        """The connection to the node `redirect` names, opened (and authenticated as the first
        one was) unless open already; `CannotConnect` naming the node when it cannot be."""
        if self._origin.startswith("wss:") and not redirect.url.startswith("wss:"):
            # The credentials would cross the network in clear to a node a server named.
            raise PieError(
                f"{self._origin} sent this client to node {redirect.node} at {redirect.url} "
                "without TLS; the client does not follow it"
            )
        async with self._opening:
            peer = self._open.get(redirect.url)
            if peer is None or peer.lost is not None:
                try:
                    peer = await self._nursery.start(self._hold, redirect.url)
                except CannotConnect as exc:
                    raise CannotConnect(exc.url, f"node {redirect.node}: {exc.reason}") from None
                self._open[redirect.url] = peer
            return peer

    async def _hold(self, url: str, *, task_status: trio.TaskStatus[Client]) -> None:
        started = False
        try:
            async with self._opener(url) as peer:
                task_status.started(peer)
                started = True
                await trio.sleep_forever()
        except PieError:
            if not started:
                raise
            # The node went away; the peer's requests and streams already say so, and the
            # next redirect there opens a new connection.


async def launch_placed(
    client: Client, program: str, text: str, snapshots: tuple[str, ...], *, here: bool = False
) -> RemoteInferlet:
    """Launches through `client`, on the node it is sent to when it is redirected (with
    `here`, on the node `client` reached: the launch says it is placed already)."""
    launched = await client._launch(program, text, snapshots, placed=here)
    if not isinstance(launched, msg.Redirect):
        return launched
    try:
        peer = await client._peer(launched)
    except CannotConnect:
        # The node named may have just died (its record outlives it a few seconds): the node
        # reached runs the launch itself rather than failing it.
        peer = client
    placed = await peer._launch(program, text, snapshots, placed=True)
    if isinstance(placed, msg.Redirect):
        raise PieError(f"{peer.where} redirected a launch that was placed already")
    return placed


async def attach_where_it_runs(client: Client, instance: str, after: int) -> RemoteInferlet:
    attached = await client._attach(instance, after)
    if isinstance(attached, msg.Redirect):
        attached = await (await client._peer(attached))._attach(instance, after)
    if isinstance(attached, msg.Redirect):
        raise PieError(f"{instance} was redirected twice (to {attached.node})")
    return attached


async def followed(client: Client, make: Callable[[int], Any]) -> Any:
    """The reply to the request `make(corr)`, sent again once to the node a `Redirect` names."""
    reply = await client._call(make(client._corr()))
    if isinstance(reply, msg.Redirect):
        peer = await client._peer(reply)
        reply = await peer._call(make(peer._corr()))
    if isinstance(reply, msg.Redirect):
        raise PieError(f"a request was redirected twice (to {reply.node})")
    return reply
