"""The serving process: its ports bound first, then the engine on the configured model behind
the WebSocket server (and the HTTP front when configured), until SIGINT or SIGTERM (the first
stops gracefully, a second at once)."""

from __future__ import annotations

import errno
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable

import attrs
import trio

from pie.config import ConfigError, EngineConfig
from pie.engine import Engine, open_engine, with_snapshots_dir
from pie.server.app import Server
from pie.server.http import HttpFront
from pie.server.mounts import prepare_mounts


class PortUnavailable(ConfigError):
    """A port or address the server cannot listen on; the message says which setting moves it."""


@attrs.define
class BoundPorts:
    """The listening sockets of the WebSocket server and (with [http] port) the HTTP front,
    opened before the model loads so that a taken port ends the start at once."""

    websocket: list[socket.socket]
    http: list[socket.socket]

    def close(self) -> None:
        """Closes what the servers did not take over (closing a taken one does nothing)."""
        for sock in (*self.websocket, *self.http):
            sock.close()


def bind_ports(config: EngineConfig) -> BoundPorts:
    """Listens on [server] host and port, and [http] port when it is 0 or more; raises
    PortUnavailable naming the flag and the config key that change a refused one."""
    host = config.server.host
    websocket = listen_on(
        host, config.server.port, "--port or [server] port", "--host or [server] host"
    )
    if config.http.port < 0:
        return BoundPorts(websocket=websocket, http=[])
    try:
        http_host = config.http.host or host
        http = listen_on(http_host, config.http.port, "--http or [http] port", "[http] host")
    except PortUnavailable:
        BoundPorts(websocket=websocket, http=[]).close()
        raise
    return BoundPorts(websocket=websocket, http=http)


def listen_on(host: str, port: int, port_setting: str, host_setting: str) -> list[socket.socket]:
    """Listening sockets on every address `host` resolves to (all interfaces when empty)."""
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise PortUnavailable(
            f"cannot listen on host {host!r} ({exc.strerror}); change it with {host_setting}"
        ) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            sockets.append(sock := socket.socket(family, kind, proto))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # As trio does: one socket per family, so that both can bind the same port.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise PortUnavailable(_refusal(exc, host, port, port_setting, host_setting)) from None
    return sockets


def _refusal(exc: OSError, host: str, port: int, port_setting: str, host_setting: str) -> str:
    hint = f"change {host_setting}"
    if exc.errno != errno.EADDRNOTAVAIL:
        hint = f"change {host_setting} or {port_setting}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host or 'every interface'} is in use by another program: stop "
            f"it, or pick another port with {port_setting} (0 picks a free one)"
        )
    if exc.errno == errno.EACCES:
        return f"port {port} needs privileges to listen on: pick one above 1023 with {port_setting}"
    return f"cannot listen on {host or 'every interface'} port {port} ({exc.strerror}): {hint}"


async def serve(
    config: EngineConfig,
    announce: Callable[[Server], None] | None = None,
    announce_http: Callable[[HttpFront], None] | None = None,
    ports: BoundPorts | None = None,
) -> None:
    """Serves until a signal; binds its ports first (unless given them bound)."""
    if ports is None:
        ports = bind_ports(config)
    try:
        await _serve(config, ports, announce, announce_http)
    finally:
        ports.close()


async def _serve(
    config: EngineConfig,
    ports: BoundPorts,
    announce: Callable[[Server], None] | None,
    announce_http: Callable[[HttpFront], None] | None,
) -> None:
    async with open_engine(with_snapshots_dir(config)) as engine:
        server = Server(engine, config.server, sockets=ports.websocket)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                front = None
                if config.http.port >= 0:
                    front = await _start_http(engine, config, server, nursery, ports.http)
                    if announce_http is not None:
                        announce_http(front)
                if announce is not None:
                    announce(server)
                nursery.start_soon(_on_signals, signals, server, front, nursery)
                await server.wait_stopped()
                if front is not None:
                    with trio.move_on_after(server.config.shutdown_seconds):
                        await front.wait_idle()
                nursery.cancel_scope.cancel()


async def _start_http(
    engine: Engine,
    config: EngineConfig,
    server: Server,
    nursery: trio.Nursery,
    sockets: list[socket.socket],
) -> HttpFront:
    mounts = await trio.to_thread.run_sync(prepare_mounts, engine, config.http)
    front = HttpFront(
        engine,
        config.http,
        mounts,
        host=config.http.host or config.server.host,
        users=server.users if server.auth_required else None,
        credential_check_seconds=config.server.credential_check_seconds,
        shutdown_seconds=config.server.shutdown_seconds,
        sockets=sockets,
    )
    await nursery.start(front.run)
    return front


async def _on_signals(
    signals: AsyncIterator[int], server: Server, front: HttpFront | None, nursery: trio.Nursery
) -> None:
    async for number in signals:
        if front is not None:
            front.stop()
        if server.stopping:
            print("pie: stopping now", file=sys.stderr)
            nursery.cancel_scope.cancel()
            return
        grace = server.config.shutdown_seconds
        print(
            f"pie: {signal.Signals(number).name}: finishing running inferlets (up to {grace:g} s;"
            " signal again to stop now)",
            file=sys.stderr,
        )
        nursery.start_soon(server.stop)
