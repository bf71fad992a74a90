"""`pie`: serve | generate | build | run | submit | list | attach | stop | status | watch |
publish | push | auth | log | replay | bench | doctor | cluster. Results go to stdout; progress
and logs to stderr. The only entry point into this package is `main`; nothing else in pie
imports it."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable, Sequence

from pie.cli.parser import build_parser

RUNNERS = {
    "serve": "pie.cli.serve:run_serve",
    "submit": "pie.cli.client:run_submit",
    "list": "pie.cli.client:run_list",
    "attach": "pie.cli.client:run_attach",
    "stop": "pie.cli.client:run_stop",
    "status": "pie.cli.client:run_status",
    "watch": "pie.cli.client:run_watch",
    "publish": "pie.cli.client:run_publish",
    "push": "pie.cli.client:run_push",
    "auth": "pie.cli.auth:run_auth",
    "generate": "pie.cli.engine:run_generate",
    "build": "pie.cli.engine:run_build",
    "run": "pie.cli.engine:run_program",
    "log": "pie.cli.log:run_log",
    "replay": "pie.cli.log:run_replay",
    "bench": "pie.cli.bench.engine:run_bench",
    "bench serve": "pie.cli.bench.serve:run_bench_serve",
    "bench inferlets": "pie.cli.bench.inferlets:run_bench_inferlets",
    "bench tax": "pie.cli.bench.tax:run_bench_tax",
    "bench agents": "pie.cli.bench.agents:run_bench_agents",
    "bench gpu": "pie.cli.bench.gpu:run_bench_gpu",
    "bench decoding": "pie.cli.bench.decoding:run_bench_decoding",
    "bench peers": "pie.cli.bench.peers:run_bench_peers",
    "bench step": "pie.cli.bench.step:run_bench_step",
    "bench media": "pie.cli.bench.media:run_bench_media",
    "bench log": "pie.cli.bench.eventlog:run_bench_log",
    "bench metrics": "pie.cli.bench.metrics:run_bench_metrics",
    "bench cluster": "pie.cli.bench.cluster:run_bench_cluster",
    "doctor": "pie.cli.doctor:run_doctor",
    "cluster status": "pie.cli.cluster:run_cluster_status",
    "cluster up": "pie.cli.cluster_up:run_cluster_up",
}
"""Each command's function, imported only when that command runs."""

INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; a failure becomes one line on stderr and exit code 2 (usage, config)
    or 1 (runtime), with its traceback too under `pie --debug` or PIE_DEBUG=1."""
    args = build_parser().parse_args(argv)
    try:
        return _runner(args)(args)
    except KeyboardInterrupt:
        return INTERRUPTED
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is not None:
            return INTERRUPTED
        return _report(group, args)
    except Exception as err:
        return _report(err, args)


def _report(err: BaseException, args: argparse.Namespace) -> int:
    from pie.cli.errors import report

    return report(err, debug=args.debug or os.environ.get("PIE_DEBUG", "") not in ("", "0"))


def _runner(args: argparse.Namespace) -> Callable[[argparse.Namespace], int]:
    action = {"bench": "suite", "cluster": "cluster_command"}.get(args.command, "")
    sub = getattr(args, action, None) if action else None
    module, _, name = RUNNERS[f"{args.command} {sub}" if sub else args.command].partition(":")
    runner: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
    return runner
