"""`pie serve`: the engine on the configured model behind the WebSocket server, until SIGINT or
SIGTERM (the first stops gracefully, a second at once)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import AsyncIterator, Callable

import trio

from pie.config import EngineConfig
from pie.engine import open_engine
from pie.server.app import Server


async def serve(config: EngineConfig, announce: Callable[[Server], None] | None = None) -> None:
    async with open_engine(config) as engine:
        server = Server(engine, config.server)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                if announce is not None:
                    announce(server)
                nursery.start_soon(_on_signals, signals, server, nursery)
                await server.wait_stopped()
                nursery.cancel_scope.cancel()


async def _on_signals(signals: AsyncIterator[int], server: Server, nursery: trio.Nursery) -> None:
    async for number in signals:
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


def run_serve(args: argparse.Namespace) -> int:
    from pie.cli import engine_config
    from pie.config import with_overrides

    config = with_overrides(
        engine_config(args), server={"host": args.host, "port": args.port, "auth": args.auth}
    )

    def announce(server: Server) -> None:
        auth = "on" if server.auth_required else "off"
        print(
            f"pie: serving {server.engine.info.model_name} on {server.url} (auth {auth})",
            file=sys.stderr,
            flush=True,
        )

    trio.run(serve, config, announce)
    print("pie: stopped", file=sys.stderr)
    return 0
