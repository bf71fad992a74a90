"""`pie bench metrics`: what Prometheus scrapes cost. Inferlets decode at once on a driver whose
pass takes a fixed time while a scraper in another process reads /metrics over HTTP again and
again; rounds with and without the scraper alternate, and the scrapes' latency and the decode
speed of both kinds of rounds are reported."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import trio

from pie.cli.bench import spread
from pie.cli.bench.inferlets import TEXT_COMPLETION, cached_component
from pie.config import EngineConfig, MetricsConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.server.http import HttpFront
from pie.server.mounts import Mounts
from pie.server.observe.metrics import EngineMetrics
from pie.server.observe.probes import probe_routes


class TimedMetrics(EngineMetrics):
    """Keeps how long each scrape held the Trio thread: what a scrape costs the engine."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine, MetricsConfig(min_scrape_ms=0))
        self.rendered: list[float] = []

    def scrape(self) -> bytes:
        started = time.perf_counter()
        text = super().scrape()
        self.rendered.append(time.perf_counter() - started)
        return text


SCRAPER = """
import json, sys, threading, time
import httpx

url, interval = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
seconds = {"/metrics": [], "/health": []}
size = 0
with httpx.Client(base_url=url, timeout=30) as client:
    while not stop.is_set():
        for path, kept in seconds.items():
            started = time.perf_counter()
            reply = client.get(path)
            kept.append(time.perf_counter() - started)
            reply.raise_for_status()
            size = len(reply.content) if path == "/metrics" else size
        if len(seconds["/health"]) == 1:
            print("ready", flush=True)
        stop.wait(interval)
print(json.dumps({"seconds": seconds, "size": size}))
"""
"""A scraper as Prometheus is one: another process. It GETs /metrics every `interval` seconds,
then /health (the event loop's own delay under the same load, for comparison), until its stdin
closes, and prints the round trips (after "ready" once the first are done: from then on its
start costs the engine nothing)."""


class Scraper:
    """The SCRAPER process, running from here until `finish` returns what it measured."""

    def __init__(self, url: str, interval: float) -> None:
        command = [sys.executable, "-c", SCRAPER, url, str(interval)]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def wait_ready(self) -> None:
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != "ready":
            raise RuntimeError("the scraper did not start")

    def finish(self) -> dict[str, Any]:
        out, _ = self._process.communicate("")
        if self._process.returncode:
            raise RuntimeError(f"the scraper failed ({self._process.returncode})")
        measured: dict[str, Any] = json.loads(out)
        return measured


async def _decode(engine: Engine, program: str, args: argparse.Namespace) -> float:
    """Tokens per second of `concurrency` greedy completions of `tokens` tokens run at once."""
    fields = {"prompt": "Count with me.", "max_tokens": args.tokens, "temperature": 0}
    request = json.dumps(fields)

    async def one() -> None:
        outcome = await engine.run_inferlet(program, request)
        if not outcome.ok:
            raise RuntimeError(f"a benchmark inferlet failed: {outcome.error}")

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(args.concurrency):
            nursery.start_soon(one)
    return args.concurrency * args.tokens / (time.perf_counter() - started)


async def _scraped(
    engine: Engine, program: str, url: str, args: argparse.Namespace
) -> tuple[float, dict[str, Any]]:
    """A decode round with a scraper running: its tokens per second, and what it measured."""
    scraper = Scraper(url, args.scrape_ms / 1000)
    try:
        await trio.to_thread.run_sync(scraper.wait_ready)
        rate = await _decode(engine, program, args)
    finally:
        measured = await trio.to_thread.run_sync(scraper.finish)
    return rate, measured


async def _rounds(
    engine: Engine, front: HttpFront, metrics: TimedMetrics, args: argparse.Namespace
) -> dict[str, Any]:
    program = engine.programs.add(cached_component(TEXT_COMPLETION), name="text-completion").hash
    await _decode(engine, program, args)
    plain: list[float] = []
    scraped: list[float] = []
    measured: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        # Which kind goes first alternates, so neither always runs on a warmer engine.
        for with_scraper in (repeat % 2 == 0, repeat % 2 == 1):
            if with_scraper:
                rate, scraper = await _scraped(engine, program, front.url, args)
                scraped.append(rate)
                measured.append(scraper)
            else:
                plain.append(await _decode(engine, program, args))
    return {**_latencies(measured, metrics.rendered), **_rates(plain, scraped)}


def _latencies(measured: list[dict[str, Any]], rendered: list[float]) -> dict[str, Any]:
    scrapes = [s for m in measured for s in m["seconds"]["/metrics"]]
    return {
        "scrapes": len(scrapes),
        "scrape_bytes": measured[-1]["size"],
        "scrape_ms": _tail(scrapes),
        "scrape_render_ms": _tail(rendered),
        "health_ms": _tail([s for m in measured for s in m["seconds"]["/health"]]),
    }


def _tail(seconds: list[float]) -> dict[str, float]:
    """The median, 95th percentile and maximum of `seconds`, in milliseconds."""
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return {"median": statistics.median(ordered) * 1e3, "p95": p95 * 1e3, "max": ordered[-1] * 1e3}


def _rates(plain: list[float], scraped: list[float]) -> dict[str, Any]:
    return {
        "tokens_per_second_without_scraper": spread(plain),
        "tokens_per_second_with_scraper": spread(scraped),
        "ratio": statistics.median(scraped) / statistics.median(plain),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pie.drivers.loader import resolve_model
    from pie.drivers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(resolve_model(None))
    driver = SyntheticDriver(pass_seconds=args.pass_ms / 1000, vocab_size=tokenizer.vocab_size)
    config = with_overrides(EngineConfig(), http={"port": 0})
    figures: dict[str, Any] = {}

    async def main() -> None:
        async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
            metrics = TimedMetrics(engine)
            routes = probe_routes(metrics, lambda: None, public_metrics=True)
            front = HttpFront(engine, config.http, Mounts({}), host="127.0.0.1", routes=routes)
            metrics.watch_http(front)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(metrics.run)
                await nursery.start(front.run)
                figures.update(await _rounds(engine, front, metrics, args))
                front.stop()
                nursery.cancel_scope.cancel()

    trio.run(main)
    return figures


def run_bench_metrics(args: argparse.Namespace) -> int:
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(
        f"fixed forward pass: {args.pass_ms} ms; {args.concurrency} text-completion inferlets "
        f"of {args.tokens} tokens at once; a scrape every {args.scrape_ms:g} ms"
    )
    print(f"{figures['scrapes']} scrapes of {figures['scrape_bytes']} bytes")
    rows = (
        ("scrape latency (client)", "scrape_ms"),
        ("scrape, the event loop held", "scrape_render_ms"),
        ("/health latency (client)", "health_ms"),
    )
    for label, key in rows:
        tail = figures[key]
        print(
            f"{label}: median {tail['median']:.1f} ms, p95 {tail['p95']:.1f} ms, "
            f"max {tail['max']:.1f} ms"
        )
    for label, key in (("without", "without_scraper"), ("with", "with_scraper")):
        rate = figures[f"tokens_per_second_{key}"]
        print(
            f"tokens/s {label} a scraper: median {rate['median']:.0f} "
            f"(range {rate['min']:.0f}-{rate['max']:.0f})"
        )
    print(f"with / without: {figures['ratio']:.3f}")
    return 0
