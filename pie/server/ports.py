"""The serving process's listening sockets, bound before the model loads so that a taken port
ends the start at once, with a message naming the setting that moves it."""

from __future__ import annotations

import errno
import socket

import attrs

from pie.config import ConfigError, EngineConfig


class PortUnavailable(ConfigError):
    """A port or address the server cannot listen on; the message says which setting moves it."""


@attrs.define
class BoundPorts:
    """The listening sockets of the WebSocket server and of the HTTP front (on [http] port, or
    on [metrics] port for a front that serves only the metrics and probes)."""

    websocket: list[socket.socket]
    http: list[socket.socket]

    def close(self) -> None:
        """Closes what the servers did not take over (closing a taken one does nothing)."""
        for sock in (*self.websocket, *self.http):
            sock.close()


def bind_ports(config: EngineConfig) -> BoundPorts:
    """Listens on [server] host and port, and on [http] port when it is 0 or more (else on
    [metrics] port when that is); raises PortUnavailable naming the flag and the config key
    that change a refused one."""
    host = config.server.host
    websocket = listen_on(
        host, config.server.port, "--port or [server] port", "--host or [server] host"
    )
    http_port, setting = config.http.port, "--http or [http] port"
    if http_port < 0:
        http_port, setting = config.metrics.port, "--metrics-port or [metrics] port"
    if http_port < 0:
        return BoundPorts(websocket=websocket, http=[])
    try:
        http = listen_on(config.http.host or host, http_port, setting, "[http] host")
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
