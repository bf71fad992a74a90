"""What every scenario shares: its command line, a server to talk to (the one given, or a
`pie serve` child process), inferlets built once into a cache, and running a program to its end."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import trio

from pie.build import cached_build
from pie.client import Client
from pie.client.local import LocalServer, mean_batch_between
from pie.config import default_cache_dir

REPO = Path(__file__).resolve().parents[1]
TEXT_COMPLETION = REPO / "sdk" / "examples" / "text-completion"

__all__ = [
    "REPO",
    "TEXT_COMPLETION",
    "LocalServer",
    "build",
    "install",
    "main",
    "mean_batch_between",
    "result_of",
    "server_url",
]


def build(folder: Path, cache_dir: Path | None = None) -> Path:
    """`folder` built into a .wasm, reused while its sources and the SDK are unchanged; the cache
    is `cache_dir`, else $PIE_CACHE_DIR/inferlets (~/.cache/pie/inferlets)."""
    return cached_build(folder, cache_dir or default_cache_dir() / "inferlets")


async def install(client: Client, folder: Path, cache_dir: Path | None = None) -> str:
    """Builds and installs `folder` under its own name; returns the program's hash, which names
    exactly these bytes whatever else is installed under the name."""
    wasm = await trio.to_thread.run_sync(build, folder, cache_dir)
    return (await client.install(wasm, name=folder.name)).hash


async def result_of(client: Client, program: str, input: dict[str, Any]) -> str:
    """Launches `program` and returns what it returned; raises when it ended otherwise."""
    outcome = await (await client.launch(program, input)).result()
    if not outcome.ok or outcome.result is None:
        raise RuntimeError(f"{program[:12]} ended {outcome.status}: {outcome.error}")
    return outcome.result


@contextlib.contextmanager
def server_url(
    server: str | None, model: str | None, env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """`server` when given; otherwise a `pie serve` child process on `model` (default: the
    configured model) for the duration, stopped gracefully at the end."""
    if server:
        yield server
        return
    local = LocalServer.start(model, env=env if env is not None else os.environ)
    try:
        yield local.url
    finally:
        code = local.stop()
        if code != 0:
            print(f"pie serve exited with {code}:\n{local.log_tail()}")


def main(
    description: str | None,
    scenario: Callable[[str], dict[str, Any]],
    summary: Callable[[dict[str, Any]], str],
) -> int:
    """The command line of a scenario's run.py: runs `scenario(url)`, prints `summary(report)`
    and the checks that failed; 0 when every check in `report["checks"]` holds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--server", help="an existing server (ws://HOST:PORT); default: start one")
    parser.add_argument("--model", help="the model the started server loads (default: its own)")
    args = parser.parse_args()
    with server_url(args.server, args.model) as url:
        report = scenario(url)
    print(summary(report))
    return _report_checks(report)


def _report_checks(report: dict[str, Any]) -> int:
    failed = [name for name, held in report["checks"].items() if not held]
    for name in failed:
        print(f"FAILED: {name}")
    print("ok" if not failed else f"{len(failed)} check(s) failed")
    return 1 if failed else 0
