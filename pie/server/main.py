"""The serving process: its ports bound first, then the engine on the configured model behind
the WebSocket server (and the HTTP front, or a front for the metrics alone, when configured),
joined to a cluster when [cluster] redis is set, until SIGINT or SIGTERM (the first stops
gracefully, a second at once)."""

from __future__ import annotations

import contextlib
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from pie.actors.runtime import Actor, Router
from pie.config import EngineConfig
from pie.engine import Engine, open_engine, with_snapshots_dir
from pie.engine.heap import settle_heap
from pie.server.app import Server
from pie.server.dashboard import Dashboard
from pie.server.discovery import discovery_routes
from pie.server.http import HttpFront
from pie.server.mounts import Mounts, prepare_mounts
from pie.server.observe.metrics import EngineMetrics
from pie.server.observe.probes import probe_routes, server_readiness
from pie.server.observe.starting import answer_while_starting
from pie.server.ports import BoundPorts, PortUnavailable, bind_ports, listen_on
from pie.server.routes import Route

if TYPE_CHECKING:
    from pie.cluster.registry import Registration
    from pie.server.placing import Placer

__all__ = ["BoundPorts", "PortUnavailable", "bind_ports", "listen_on", "serve"]


async def serve(
    config: EngineConfig,
    announce: Callable[[Server], None] | None = None,
    announce_http: Callable[[HttpFront], None] | None = None,
    ports: BoundPorts | None = None,
) -> None:
    """Serves until a signal; binds its ports first (unless given them bound)."""
    if config.cluster.redis and not config.cluster.node_id:
        # Named before the engine starts, so that its bus and its registration agree.
        cluster = attrs.evolve(config.cluster, node_id=f"node-{secrets.token_hex(4)}")
        config = attrs.evolve(config, cluster=cluster)
    if ports is None:
        ports = bind_ports(config)
    try:
        if config.cluster.redis:
            # Before the model loads, as a taken port is: a wrong URL ends the start at once.
            from pie.cluster.store import check_reachable

            await check_reachable(config.cluster.redis, config.cluster.connect_timeout_seconds)
        await _serve(config, ports, announce, announce_http)
    finally:
        ports.close()


async def _serve(
    config: EngineConfig,
    ports: BoundPorts,
    announce: Callable[[Server], None] | None,
    announce_http: Callable[[HttpFront], None] | None,
) -> None:
    async with trio.open_nursery() as starting:
        # The HTTP port answers /health and /ready ("starting") while the model loads.
        loaded = await starting.start(answer_while_starting, ports.http)
        async with (
            open_engine(with_snapshots_dir(config), bus=_bus(config)) as engine,
            _shared(config) as shared,
        ):
            loaded()
            await _serve_engine(engine, shared, config, ports, announce, announce_http)


async def _serve_engine(
    engine: Engine,
    shared: Any,
    config: EngineConfig,
    ports: BoundPorts,
    announce: Callable[[Server], None] | None,
    announce_http: Callable[[HttpFront], None] | None,
) -> None:
    server = Server(
        engine,
        config.server,
        sockets=ports.websocket,
        shared_programs=shared.programs if shared else None,
        users=shared.users if shared else None,
        placer=_placer(config, shared, engine),
    )
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            node = None
            if shared is not None:
                from pie.server.clustered import share_node

                node = await share_node(shared, config.cluster, server, nursery)
            routes = node.routes if node is not None else ()
            front = await _start_http(engine, config, server, nursery, ports.http, routes)
            if front is not None and announce_http is not None:
                announce_http(front)
            registration: Registration | None = None
            if node is not None:
                from pie.server.joining import join_cluster

                back = node.redis_back
                registration = await nursery.start(
                    join_cluster, config.cluster, server, front, back
                )
            settle_heap()
            if announce is not None:
                announce(server)
            nursery.start_soon(_on_signals, signals, server, front, nursery, registration)
            await server.wait_stopped()
            if front is not None:
                with trio.move_on_after(server.config.shutdown_seconds):
                    await front.wait_idle()
            nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def _shared(config: EngineConfig) -> AsyncIterator[Any]:
    """The cluster's programs and users when [cluster] redis is set, else None."""
    if not config.cluster.redis:
        yield None
        return
    from pie.server.clustered import open_shared_state

    async with open_shared_state(config.cluster) as shared:
        yield shared


def _placer(config: EngineConfig, shared: Any, engine: Engine) -> Placer | None:
    """Where a clustered node's launches go ([cluster] placement), None on a node alone."""
    if shared is None:
        return None
    from pie.server.placing import Placer

    return Placer(shared.store, config.cluster, engine)


def _bus(config: EngineConfig) -> Callable[[Router], Actor] | None:
    """A clustered node's bus, which shares its queues and topics through Redis."""
    if not config.cluster.redis:
        return None
    from pie.actors.bus import BusLimits
    from pie.cluster.bus import cluster_bus

    limits = BusLimits.from_config(config.bus)
    return cluster_bus(config.cluster, limits, config.cluster.node_id)


async def _start_http(
    engine: Engine,
    config: EngineConfig,
    server: Server,
    nursery: trio.Nursery,
    sockets: list[socket.socket],
    cluster_routes: tuple[Route, ...] = (),
) -> HttpFront | None:
    """The HTTP front with its programs, the metrics routes and the pages a router in front of
    several nodes reads (discovery.py); without [http] port, a front serving only the metrics
    routes on [metrics] port; None when neither is set."""
    http = config.http
    if http.port >= 0:
        mounts = await trio.to_thread.run_sync(prepare_mounts, engine, http)
    elif config.metrics.port >= 0:
        mounts, http = Mounts({}), attrs.evolve(http, port=config.metrics.port)
    else:
        return None
    metrics = EngineMetrics(engine, config.metrics)
    metrics.watch_server(server)
    routes = probe_routes(metrics, server_readiness(server), public_metrics=config.metrics.public)
    if config.http.port >= 0:
        routes += discovery_routes([stack.name for stack in engine.models])
        routes += _dashboard_routes(engine, config, server)
        routes += cluster_routes
    front = HttpFront(
        engine,
        http,
        mounts,
        host=http.host or config.server.host,
        users=server.users if server.auth_required else None,
        credential_check_seconds=config.server.credential_check_seconds,
        shutdown_seconds=config.server.shutdown_seconds,
        routes=routes,
        sockets=sockets,
    )
    metrics.watch_http(front)
    nursery.start_soon(metrics.run)
    await nursery.start(front.run)
    return front


def _dashboard_routes(engine: Engine, config: EngineConfig, server: Server) -> tuple[Route, ...]:
    """The live dashboard's pages, when [dashboard] enabled."""
    if not config.dashboard.enabled:
        return ()
    dashboard = Dashboard(
        engine,
        config.dashboard,
        users=server.users if server.auth_required else None,
        stopping=lambda: server.stopping,
        credential_check_seconds=config.server.credential_check_seconds,
    )
    return dashboard.routes()


async def _on_signals(
    signals: AsyncIterator[int],
    server: Server,
    front: HttpFront | None,
    nursery: trio.Nursery,
    registration: Registration | None,
) -> None:
    """The first signal stops taking work (a clustered node leaves the cluster at once) and
    lets running inferlets finish; a second stops now."""
    async for number in signals:
        if front is not None:
            front.stop()
        if registration is not None:
            registration.leave()
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
