"""`pie`: serve | generate | build | run | submit | list | attach | stop | status | watch |
publish | push | auth | log | replay | bench. Results go to stdout; progress and logs to stderr."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pie import __version__

DEFAULT_SERVER_URL = "ws://127.0.0.1:8080"
"""Where `pie serve` listens by default ([server] host and port)."""

RUNNERS = {
    "serve": "pie.server.main:run_serve",
    "submit": "pie.client.cli:run_submit",
    "list": "pie.client.cli:run_list",
    "attach": "pie.client.cli:run_attach",
    "stop": "pie.client.cli:run_stop",
    "status": "pie.client.cli:run_status",
    "watch": "pie.client.cli:run_watch",
    "publish": "pie.client.cli:run_publish",
    "push": "pie.client.cli:run_push",
    "auth": "pie.server.auth_cli:run_auth",
    "generate": "pie.commands:run_generate",
    "build": "pie.commands:run_build",
    "run": "pie.commands:run_program",
    "log": "pie.commands:run_log",
    "replay": "pie.commands:run_replay",
    "bench": "pie.bench:run_bench",
    "bench serve": "pie.bench_serve:run_bench_serve",
    "bench inferlets": "pie.bench_inferlets:run_bench_inferlets",
    "bench tax": "pie.bench_tax:run_bench_tax",
    "bench agents": "pie.bench_agents:run_bench_agents",
}
"""Each command's function, imported only when that command runs."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie", description="A programmable LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"pie {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    _engine_options(serve)

    gen = commands.add_parser("generate", help="complete one prompt on the configured model")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _engine_options(gen)

    build = commands.add_parser("build", help="build an inferlet folder into a .wasm component")
    build.add_argument("folder", help="a folder with main.py defining `async def main(input)`")
    build.add_argument("-o", "--output", help="the component to write (default: FOLDER.wasm)")

    run = commands.add_parser("run", help="run an inferlet component on the configured model")
    run.add_argument("program", help="a .wasm component made by `pie build`")
    run.add_argument("--input", default="", help="the inferlet's input (JSON by convention)")
    _engine_options(run)

    from pie.server.auth_cli import add_auth_parser

    add_client_parsers(commands)
    add_auth_parser(commands)

    log = commands.add_parser("log", help="print an event log file readably")
    log.add_argument("file")
    log.add_argument("--actor", help="only events sent to or by this address")
    log.add_argument("--corr", type=int, help="only events of this correlation id")
    log.add_argument("--limit", type=int, default=0, help="print at most this many")

    replay = commands.add_parser("replay", help="replay an actor's inputs from an event log")
    replay.add_argument("file")
    replay.add_argument("--actor", default="kv", choices=["kv"])

    bench = commands.add_parser("bench", help="measure decode/prefill speed against transformers")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--decode-tokens", type=int, default=64)
    bench.add_argument("--concurrency", type=int, default=16)
    bench.add_argument("--prefill-tokens", type=int, default=256)
    bench.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    _engine_options(bench)
    suites = bench.add_subparsers(dest="suite", metavar="[inferlets | serve | tax | agents]")
    inferlets = suites.add_parser(
        "inferlets", help="runtime overhead per token, launch latency and memory of inferlets"
    )
    inferlets.add_argument("--json", action="store_true", help="print one JSON object")
    inferlets.add_argument("--pass-ms", type=float, default=5.0, help="fixed forward pass time")
    inferlets.add_argument("--tokens", type=int, default=64, help="tokens per measured run")
    inferlets.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    inferlets.add_argument("--repeats", type=int, default=3)
    inferlets.add_argument("--idle", type=int, default=16, help="idle inferlets to weigh")
    agents = suites.add_parser(
        "agents", help="an agent loop with tool calls: in the engine vs a client re-sending"
    )
    agents.add_argument("--json", action="store_true", help="print one JSON object")
    agents.add_argument("--tasks", type=int, default=16, help="agent tasks at once")
    agents.add_argument("--calls", type=int, default=8, help="tool calls per task")
    agents.add_argument("--tool-ms", type=float, default=50.0, help="how long a tool call takes")
    agents.add_argument("--tokens", type=int, default=8, help="tokens generated per step")
    agents.add_argument(
        "--pass-ms", type=float, help="a fixed-time forward pass instead of the configured model"
    )
    tax = suites.add_parser(
        "tax", help="exposed runtime time per token at each speculation depth (fixed-time pass)"
    )
    tax.add_argument("--json", action="store_true", help="print one JSON object")
    tax.add_argument("--pass-ms", type=float, default=5.0, help="fixed forward pass time")
    tax.add_argument("--tokens", type=int, default=64, help="tokens per measured run")
    tax.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    tax.add_argument("--depths", type=int, nargs="+", default=[0, 1, 4])
    tax.add_argument("--think-us", type=float, default=0.0, help="guest busy work per token")
    tax.add_argument("--repeats", type=int, default=3)
    tax.add_argument("--slow-path", action="store_true", help="also run with the fast path off")
    tax.add_argument("--real", action="store_true", help="the configured model, not a fixed pass")
    _engine_options(tax)
    _engine_options(agents)
    add_bench_serve_parser(suites)
    return parser


def add_client_parsers(subparsers: Any) -> None:
    """Registers submit, list, attach, stop, status, watch, publish and push on `pie`'s
    sub-command parsers."""
    submit = subparsers.add_parser("submit", help="install an inferlet on a server and run it")
    submit.add_argument(
        "program", help="a .wasm component made by `pie build`, or an inferlet folder to build"
    )
    submit.add_argument("--input", default="", help="the inferlet's input (JSON by convention)")
    submit.add_argument("--name", help="install under this name (default: the file's stem)")
    submit.add_argument("--version", default="0.1.0", help="install under this version")
    submit.add_argument("--detach", action="store_true", help="print the instance id and leave")
    listing = subparsers.add_parser("list", help="your inferlets on a server")
    attach = subparsers.add_parser("attach", help="stream a running inferlet's output")
    attach.add_argument("instance")
    attach.add_argument("--after", type=int, default=0, help="replay events after this seq")
    stop = subparsers.add_parser("stop", help="terminate an inferlet")
    stop.add_argument("instance")
    status = subparsers.add_parser("status", help="a server's engine statistics")
    watch = subparsers.add_parser("watch", help="print the messages broadcast on topics")
    watch.add_argument("topics", nargs="+", metavar="TOPIC")
    watch.add_argument("--count", type=int, default=0, help="stop after N messages (0: never)")
    watch.add_argument("--json", action="store_true", help="one JSON object per message")
    publish = subparsers.add_parser("publish", help="broadcast a message on a topic")
    publish.add_argument("topic")
    publish.add_argument("message")
    push = subparsers.add_parser("push", help="append a message to a queue")
    push.add_argument("queue")
    push.add_argument("message")
    for parser in (submit, listing, attach, stop, status, watch, publish, push):
        _connection_options(parser)


def _connection_options(parser: argparse.ArgumentParser) -> None:
    server = os.environ.get("PIE_SERVER", DEFAULT_SERVER_URL)
    parser.add_argument("--server", default=server, help=f"WebSocket URL (default: {server})")
    parser.add_argument("--user", default=os.environ.get("PIE_USER"), help="authenticate as")
    parser.add_argument("--token", default=os.environ.get("PIE_TOKEN"), help="a user's token")
    parser.add_argument("--key", help="sign the server's challenge with this private key")


def add_bench_serve_parser(suites: Any) -> None:
    """Registers `pie bench serve` on the `bench` command's suites."""
    serve = suites.add_parser(
        "serve", help="latency and throughput of streamed completions through pie serve"
    )
    serve.add_argument("--json", action="store_true", help="print one JSON object")
    serve.add_argument(
        "--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients per round"
    )
    serve.add_argument("--tokens", type=int, default=32, help="max_tokens of each completion")
    serve.add_argument("--server", help="measure this server (ws://HOST:PORT) instead of a new one")
    serve.add_argument("--model", help="model for the started server (default: the configured)")


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="engine config file (TOML)")
    parser.add_argument("--model", help="HF model directory, .gguf file, or smollm2-135m")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N")


def engine_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pie.config import load_config, with_overrides

    config = load_config(args.config)
    return with_overrides(
        config, model={"path": args.model, "dtype": args.dtype, "device": args.device}
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pie.config import ConfigError

    try:
        return _runner(args)(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"pie: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _runner(args: argparse.Namespace) -> Callable[[argparse.Namespace], int]:
    suite = getattr(args, "suite", None) if args.command == "bench" else None
    module, _, name = RUNNERS[f"bench {suite}" if suite else args.command].partition(":")
    runner: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
    return runner


if __name__ == "__main__":
    sys.exit(main())
