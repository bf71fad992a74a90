"""`pie bench serve`: what a client of `pie serve` sees: launch-to-first-token and per-token
latency of streamed text completions, and throughput and server CPU per token, for several
numbers of concurrent WebSocket clients."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import psutil
import trio

from pie.client import SessionMessage, connect
from pie.client.local import LocalServer, mean_batch_between

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@attrs.define
class ClientRun:
    """One client's stream: seconds from sending Launch to the first piece, and the arrival
    times of every piece."""

    first_token: float
    arrivals: list[float]

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


@attrs.define
class _Start:
    """Holds every client until all are connected, so connecting is not measured."""

    expected: int
    connected: int = 0
    all_connected: trio.Event = attrs.Factory(trio.Event)
    go: trio.Event = attrs.Factory(trio.Event)

    async def arrive(self) -> None:
        self.connected += 1
        if self.connected == self.expected:
            self.all_connected.set()
        await self.go.wait()


async def _one_client(url: str, program: str, tokens: int, start: _Start) -> ClientRun:
    request = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    async with connect(url) as client:
        await start.arrive()
        started = time.perf_counter()
        inferlet = await client.launch(program, request)
        arrivals = [
            time.perf_counter()
            async for event in inferlet.events()
            if isinstance(event, SessionMessage)
        ]
        outcome = inferlet.outcome
    if outcome is None or not outcome.ok:
        raise RuntimeError(f"a benchmark client's inferlet did not return: {outcome}")
    if not arrivals:
        raise RuntimeError("a benchmark client got no streamed text")
    return ClientRun(first_token=arrivals[0] - started, arrivals=arrivals)


async def _round(
    url: str, program: str, clients: int, tokens: int
) -> tuple[list[ClientRun], float]:
    """`clients` streams started together once all are connected; their runs and the wall time
    from the start to the last result."""
    runs: list[ClientRun] = []
    start = _Start(clients)

    async def one() -> None:
        runs.append(await _one_client(url, program, tokens, start))

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(one)
        await start.all_connected.wait()
        started = time.perf_counter()
        start.go.set()
    return runs, time.perf_counter() - started


def _percentiles(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    p50, p99 = np.percentile(np.asarray(values), [50, 99])
    return float(p50), float(p99)


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def _measure_row(
    url: str, program: str, clients: int, tokens: int, pid: int | None
) -> dict[str, Any]:
    async with connect(url) as client:
        stats_before = await client.statistics()
        cpu_before = _cpu_seconds(pid)
        runs, wall = await _round(url, program, clients, tokens)
        cpu_after = _cpu_seconds(pid)
        stats_after = await client.statistics()
    generated = sum(len(run.arrivals) for run in runs)
    ttft = _percentiles([run.first_token for run in runs])
    gaps = _percentiles([gap for run in runs for gap in run.gaps])
    row: dict[str, Any] = {
        "clients": clients,
        "tokens": generated,
        "wall_s": wall,
        "first_token_p50_ms": ttft[0] * 1e3,
        "first_token_p99_ms": ttft[1] * 1e3,
        "token_p50_ms": gaps[0] * 1e3,
        "token_p99_ms": gaps[1] * 1e3,
        "tokens_per_s": generated / wall,
        "mean_batch_size": mean_batch_between(stats_before, stats_after),
        "server_cpu_ms_per_token": None,
    }
    if cpu_before is not None and cpu_after is not None:
        row["server_cpu_ms_per_token"] = (cpu_after - cpu_before) / generated * 1e3
    return row


async def _measure(url: str, args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    from pie.cli.bench.inferlets import TEXT_COMPLETION, cached_component

    wasm = await trio.to_thread.run_sync(cached_component, TEXT_COMPLETION)
    async with connect(url) as client:
        program = (await client.install(wasm, name="text-completion")).hash
        model = client.welcome.model if client.welcome else ""
    # The warm-up instantiates the component and runs every batch size once, unmeasured.
    await _round(url, program, max(args.clients), 2)
    rows = [await _measure_row(url, program, n, args.tokens, pid) for n in args.clients]
    return {"model": model, "prompt": PROMPT, "max_tokens": args.tokens, "rows": rows}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark against `args.server`, or a `pie serve` child process on `args.model`."""
    if args.server:
        return trio.run(_measure, args.server, args, None)
    print("pie: starting pie serve ...", file=sys.stderr)
    with LocalServer.start(args.model, env=os.environ) as server:
        figures = trio.run(_measure, server.url, args, server.pid)
        figures["server_cpus"] = psutil.cpu_count()
    return figures


def run_bench_serve(args: argparse.Namespace) -> int:
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"{figures['model']}: text-completion, greedy, streamed, max_tokens {args.tokens}")
    print(
        f"{'clients':>7}{'first p50':>11}{'first p99':>11}{'token p50':>11}{'token p99':>11}"
        f"{'tokens/s':>10}{'batch':>7}{'cpu ms/tok':>12}"
    )
    for row in figures["rows"]:
        cpu = row["server_cpu_ms_per_token"]
        print(
            f"{row['clients']:>7}{row['first_token_p50_ms']:>9.0f}ms"
            f"{row['first_token_p99_ms']:>9.0f}ms{row['token_p50_ms']:>9.0f}ms"
            f"{row['token_p99_ms']:>9.0f}ms{row['tokens_per_s']:>10.1f}"
            f"{row['mean_batch_size']:>7.1f}{'-' if cpu is None else f'{cpu:.1f}':>12}"
        )
    return 0
