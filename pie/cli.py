"""`pie`: serve | generate | build | run | submit | list | attach | stop | status | auth | log |
replay | bench. Results go to stdout; progress and logs to stderr."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pie import __version__

CLIENT_COMMANDS = ("submit", "list", "attach", "stop", "status")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie", description="A programmable LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"pie {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve the configured model over WebSocket")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8080; 0 picks a free one)")
    serve.add_argument("--auth", choices=["auto", "on", "off"], help="default: auto")
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

    from pie.client.cli import add_client_parsers
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
    suites = bench.add_subparsers(dest="suite", metavar="[inferlets | serve]")
    inferlets = suites.add_parser(
        "inferlets", help="runtime overhead per token, launch latency and memory of inferlets"
    )
    inferlets.add_argument("--json", action="store_true", help="print one JSON object")
    inferlets.add_argument("--pass-ms", type=float, default=5.0, help="fixed forward pass time")
    inferlets.add_argument("--tokens", type=int, default=64, help="tokens per measured run")
    inferlets.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    inferlets.add_argument("--repeats", type=int, default=3)
    inferlets.add_argument("--idle", type=int, default=16, help="idle inferlets to weigh")
    from pie.bench_serve import add_bench_serve_parser

    add_bench_serve_parser(suites)
    return parser


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
        if args.command == "serve":
            from pie.server.main import run_serve

            return run_serve(args)
        if args.command in CLIENT_COMMANDS:
            from pie.client import cli as client_cli

            return getattr(client_cli, f"run_{args.command}")(args)
        if args.command == "auth":
            from pie.server.auth_cli import run_auth

            return run_auth(args)
        if args.command == "generate":
            from pie.commands import run_generate

            return run_generate(args)
        if args.command == "build":
            from pie.commands import run_build

            return run_build(args)
        if args.command == "run":
            from pie.commands import run_program

            return run_program(args)
        if args.command == "log":
            from pie.commands import run_log

            return run_log(args)
        if args.command == "replay":
            from pie.commands import run_replay

            return run_replay(args)
        if getattr(args, "suite", None) == "serve":
            from pie.bench_serve import run_bench_serve

            return run_bench_serve(args)
        if getattr(args, "suite", None) == "inferlets":
            from pie.bench_inferlets import run_bench_inferlets

            return run_bench_inferlets(args)
        from pie.bench import run_bench

        return run_bench(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"pie: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
