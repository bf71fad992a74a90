"""The `pie` argument parser: one function per command family. It imports nothing heavy, so
`pie --help` and the dispatch stay fast; each command's body lives in its own module."""

from __future__ import annotations

import argparse
from typing import Any

from pie import __version__
from pie.cli.bench_parsers import add_bench_parsers
from pie.cli.options import add_cluster_url_option, add_connection_options, add_engine_options

Commands = Any
"""The object `add_subparsers` returns (argparse gives it no public type)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie", description="A programmable LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"pie {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of an error, not just its line"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(commands)
    add_engine_parsers(commands)
    add_client_parsers(commands)
    add_auth_parser(commands)
    add_log_parsers(commands)
    add_bench_parsers(commands)
    add_doctor_parser(commands)
    add_cluster_parser(commands)
    return parser


def add_doctor_parser(commands: Commands) -> None:
    doctor = commands.add_parser(
        "doctor", help="the device, the driver the engine would pick and why, and kernel checks"
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_options(doctor)


def add_serve_parser(commands: Commands) -> None:
    serve = commands.add_parser("serve", help="serve the configured model over WebSocket")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8080; 0 picks a free one)")
    serve.add_argument("--auth", choices=["auto", "on", "off"], help="default: auto")
    serve.add_argument(
        "--http", type=int, metavar="PORT", help="also serve HTTP inferlets on PORT (0: any free)"
    )
    serve.add_argument(
        "--mount",
        action="append",
        default=[],
        metavar="PREFIX=PROGRAM",
        help="serve PROGRAM (name, hash, .wasm or folder) under the HTTP path PREFIX; repeatable",
    )
    serve.add_argument(
        "--openai", action="store_true", help="serve the OpenAI-compatible API at /v1 on --http"
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve /metrics, /health and /ready on PORT, without --http (with it, they are "
        "served there)",
    )
    serve.add_argument(
        "--cluster",
        metavar="URL",
        help="join the cluster whose nodes share the Redis at URL (redis://HOST:PORT[/DB])",
    )
    add_engine_options(serve)


def add_cluster_parser(commands: Commands) -> None:
    """`cluster status | up`: the nodes joined through one Redis; a cluster on this machine."""
    cluster = commands.add_parser("cluster", help="the nodes that share one Redis")
    actions = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    status = actions.add_parser("status", help="the nodes with their URLs, models and load")
    add_cluster_url_option(status)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    up = actions.add_parser(
        "up", help="Redis, N nodes and the SGLang router on this machine, until Ctrl-C"
    )
    up.add_argument("--nodes", type=int, default=2, help="pie serve nodes to start (default 2)")
    up.add_argument(
        "--router-port", type=int, default=30000, help="the router's port (default 30000; 0: free)"
    )
    up.add_argument(
        "--policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "random", "power_of_two"],
        help="the router's policy (default cache_aware)",
    )
    up.add_argument("--cluster", metavar="URL", help="use the Redis at URL instead of starting one")
    up.add_argument(
        "--state-dir",
        metavar="DIR",
        help="Redis's files and each node's (default: cluster/ in the cache dir)",
    )
    up.add_argument("--config", help="engine config file (TOML) for every node")
    up.add_argument(
        "--model", action="append", default=[], metavar="[NAME=]PATH", help="as for pie serve"
    )
    up.add_argument("--json", action="store_true", help="print the URLs as one JSON object")


def add_engine_parsers(commands: Commands) -> None:
    """generate, build and run: the engine in this process, no server."""
    gen = commands.add_parser("generate", help="complete one prompt on the configured model")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_options(gen)

    build = commands.add_parser("build", help="build an inferlet folder into a .wasm component")
    build.add_argument("folder", help="a folder with main.py defining `async def main(input)`")
    build.add_argument("-o", "--output", help="the component to write (default: FOLDER.wasm)")

    run = commands.add_parser("run", help="run an inferlet component on the configured model")
    run.add_argument("program", help="a .wasm component made by `pie build`")
    run.add_argument("--input", default="", help="the inferlet's input (JSON by convention)")
    run.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="PATH",
        help="send the file's bytes to the inferlet's session after launch (repeatable, in order)",
    )
    add_engine_options(run)


def add_client_parsers(commands: Commands) -> None:
    """submit, list, attach, stop, status, watch, publish and push: a client of `pie serve`."""
    submit = commands.add_parser("submit", help="install an inferlet on a server and run it")
    submit.add_argument(
        "program", help="a .wasm component made by `pie build`, or an inferlet folder to build"
    )
    submit.add_argument("--input", default="", help="the inferlet's input (JSON by convention)")
    submit.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="PATH",
        help="send the file's bytes to the inferlet's session after launch (repeatable, in order)",
    )
    submit.add_argument("--name", help="install under this name (default: the file's stem)")
    submit.add_argument(
        "--version",
        help="install under this version (default: 0.1.0; when the default name@version holds "
        "another build, this one is installed under its hash and run by it)",
    )
    submit.add_argument(
        "--snapshot",
        action="append",
        default=[],
        metavar="NAME",
        help="a named snapshot the inferlet opens: in a cluster it runs on the node holding it "
        "(repeatable)",
    )
    submit.add_argument("--detach", action="store_true", help="print the instance id and leave")
    listing = commands.add_parser("list", help="your inferlets on a server")
    attach = commands.add_parser("attach", help="stream a running inferlet's output")
    attach.add_argument("instance")
    attach.add_argument("--after", type=int, default=0, help="replay events after this seq")
    stop = commands.add_parser("stop", help="terminate an inferlet")
    stop.add_argument("instance")
    status = commands.add_parser("status", help="a server's engine statistics")
    for parser in (submit, listing, attach, stop, status, *_bus_parsers(commands)):
        add_connection_options(parser)


def _bus_parsers(commands: Commands) -> tuple[argparse.ArgumentParser, ...]:
    watch = commands.add_parser("watch", help="print the messages broadcast on topics")
    watch.add_argument("topics", nargs="+", metavar="TOPIC")
    watch.add_argument("--count", type=int, default=0, help="stop after N messages (0: never)")
    watch.add_argument("--json", action="store_true", help="one JSON object per message")
    publish = commands.add_parser("publish", help="broadcast a message on a topic")
    publish.add_argument("topic")
    publish.add_argument("message")
    push = commands.add_parser("push", help="append a message to a queue")
    push.add_argument("queue")
    push.add_argument("message")
    return watch, publish, push


def add_auth_parser(commands: Commands) -> None:
    """`auth add|remove|list`: the users of `pie serve`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--users-dir",
        metavar="DIR",
        default=None,
        help="where users live (default: $PIE_CONFIG_DIR/users or ~/.config/pie/users)",
    )
    common.add_argument(
        "--cluster",
        metavar="URL",
        default=None,
        help="manage the users of the cluster at this Redis URL instead of a directory",
    )
    auth = commands.add_parser("auth", help="manage the users of `pie serve`")
    actions = auth.add_subparsers(dest="auth_command", required=True, metavar="ACTION")

    add = actions.add_parser(
        "add", parents=[common], help="create a user or give it a new token or key"
    )
    add.add_argument("user")
    add.add_argument("--key", metavar="PATH", default=None, help="a public key file to accept")
    add.add_argument("--no-token", action="store_true", help="do not make a new token")

    remove = actions.add_parser("remove", parents=[common], help="delete a user")
    remove.add_argument("user")
    remove.set_defaults(key=None, no_token=False)

    listing = actions.add_parser("list", parents=[common], help="show users and their keys")
    listing.set_defaults(user=None, key=None, no_token=False)


def add_log_parsers(commands: Commands) -> None:
    """log and replay: reading an event log."""
    log = commands.add_parser("log", help="print an event log file readably")
    log.add_argument("file")
    log.add_argument("--actor", help="only events sent to or by this address")
    log.add_argument("--corr", type=int, help="only events of this correlation id")
    log.add_argument("--limit", type=int, default=0, help="print at most this many")
    log.add_argument("--tree", type=int, metavar="SEQ", help="the deliveries SEQ caused, as a tree")
    log.add_argument(
        "--root", action="store_true", help="with --tree: start from the first cause of SEQ"
    )

    replay = commands.add_parser(
        "replay", help="replay the engine's pure cores from an event log and check them"
    )
    replay.add_argument("file")
    replay.add_argument(
        "--actor",
        choices=["kv", "bus", "inferlets", "former"],
        help="only this kind of core (default: all of them)",
    )
    replay.add_argument(
        "--inferlet", metavar="ID", help="run this recorded inferlet again against its host calls"
    )
    replay.add_argument(
        "--program",
        metavar="PATH",
        help="with --inferlet: run this .wasm instead of the recorded one",
    )
