"""The body of `pie serve`: the config from the command line, then the server until a signal."""

from __future__ import annotations

import argparse
import sys

import trio

from pie.cli.options import engine_config
from pie.config import with_overrides
from pie.server.app import Server
from pie.server.http import HttpFront
from pie.server.main import serve


def run_serve(args: argparse.Namespace) -> int:
    config = engine_config(args)
    mounts = dict(config.http.mounts)
    for mount in args.mount:
        prefix, sep, program = mount.partition("=")
        if not sep:
            raise ValueError(f"--mount wants PREFIX=PROGRAM, got {mount!r}")
        mounts[prefix] = program
    config = with_overrides(
        config,
        server={"host": args.host, "port": args.port, "auth": args.auth},
        http={"port": args.http, "mounts": mounts, "openai": args.openai or None},
        metrics={"port": args.metrics_port},
        cluster={"redis": args.cluster},
    )
    if config.http.port < 0 and (config.http.mounts or config.http.openai):
        raise ValueError("--mount and --openai serve over HTTP: give --http PORT too")
    if config.http.port >= 0 and config.metrics.port >= 0:
        raise ValueError(
            "--metrics-port ([metrics] port) is for a server without --http ([http] port); "
            "with it, /metrics, /health and /ready are served on the HTTP port: drop one"
        )

    def announce(server: Server) -> None:
        auth = "on" if server.auth_required else "off"
        names = ", ".join(m.name for m in server.engine.models)
        print(
            f"pie: serving {names} on {server.url} (auth {auth})",
            file=sys.stderr,
            flush=True,
        )

    def announce_http(front: HttpFront) -> None:
        for prefix, program in sorted(front.mounts.programs.items()):
            print(f"pie: {front.url}{prefix} serves {program[:16]}", file=sys.stderr)
        if not front.mounts.programs and config.http.port >= 0:
            print(f"pie: HTTP on {front.url}, nothing mounted", file=sys.stderr)
        print(f"pie: metrics at {front.url}/metrics", file=sys.stderr)

    trio.run(serve, config, announce, announce_http)
    print("pie: stopped", file=sys.stderr)
    return 0
