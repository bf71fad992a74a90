"""`pie bench inferlets`: what running a program inside the engine costs around the forward
pass. A driver whose pass takes a fixed time stands in for the model, so every microsecond
above that time is runtime overhead: host calls, actor hops, batching and result delivery."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import trio

from pie.build import SDK, cached_build
from pie.config import EngineConfig, default_cache_dir, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine

TEXT_COMPLETION = SDK / "examples" / "text-completion"
IDLE_SOURCE = '''"""Waits for one session message and returns it: an inferlet that sits idle."""

from inferlet import session


async def main(input):
    return await session.receive()
'''


def cached_component(folder: Path) -> bytes:
    """The folder built with `pie build`, reused while its sources and the SDK are unchanged."""
    return cached_build(folder, default_cache_dir() / "inferlets").read_bytes()


def component_from_source(name: str, source: str) -> bytes:
    """A one-file inferlet (`main.py` = `source`), built and cached like a folder."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / name
        folder.mkdir()
        (folder / "main.py").write_text(source)
        return cached_component(folder)


async def _completions(
    engine: Engine, program: str, concurrency: int, tokens: int, extra: dict[str, Any]
) -> float:
    """Wall time for `concurrency` greedy completions of `tokens` tokens each, run at once;
    `extra` goes into each request."""
    fields = {"prompt": "Count with me.", "max_tokens": tokens, "temperature": 0, **extra}
    request = json.dumps(fields)
    failures: list[str] = []

    async def one() -> None:
        outcome = await engine.run_inferlet(program, request)
        if not outcome.ok:
            failures.append(outcome.error or outcome.status)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(one)
    if failures:
        raise RuntimeError(f"a benchmark inferlet failed: {failures[0]}")
    return time.perf_counter() - started


async def per_token_seconds(
    engine: Engine,
    program: str,
    concurrency: int,
    *,
    tokens: int,
    repeats: int,
    extra: dict[str, Any] | None = None,
) -> float:
    """Per-token wall time of one of `concurrency` generations running at once, from the
    difference of a short and a long run, so that launch and prefill cancel out; the median of
    `repeats`, after one warm-up run."""
    short, long = 4, 4 + tokens
    extra = extra or {}
    await _completions(engine, program, concurrency, short, extra)
    per_token = []
    for _ in range(repeats):
        a = await _completions(engine, program, concurrency, short, extra)
        b = await _completions(engine, program, concurrency, long, extra)
        per_token.append((b - a) / (long - short))
    return statistics.median(per_token)


async def _overhead(engine: Engine, program: str, concurrency: int, args: Any) -> dict[str, float]:
    wall = await per_token_seconds(
        engine, program, concurrency, tokens=args.tokens, repeats=args.repeats
    )
    pass_seconds = args.pass_ms / 1000
    return {
        "us_per_token": wall * 1e6,
        "overhead_us_per_token": (wall - pass_seconds) * 1e6,
        "tokens_per_second": concurrency / wall,
        "ideal_tokens_per_second": concurrency / pass_seconds,
    }


async def _launch_latency(
    config: EngineConfig, driver_args: dict[str, Any], tokenizer: Any, wasm: bytes
) -> dict[str, float]:
    """A 1-token completion from launch to result: first on a new engine (the component comes
    from the disk cache), then again on the same engine."""
    request = json.dumps({"prompt": "Hi", "max_tokens": 1, "temperature": 0})
    async with open_engine(
        config, driver=SyntheticDriver(**driver_args), tokenizer=tokenizer
    ) as engine:
        program = engine.programs.add(wasm).hash
        started = time.perf_counter()
        await engine.run_inferlet(program, request)
        cold = time.perf_counter() - started
        warm = []
        for _ in range(10):
            started = time.perf_counter()
            await engine.run_inferlet(program, request)
            warm.append(time.perf_counter() - started)
    return {"cold_launch_ms": cold * 1e3, "warm_launch_ms": statistics.median(warm) * 1e3}


async def _idle_memory(engine: Engine, wasm: bytes, count: int) -> float:
    """Resident memory each inferlet adds while it waits for a message, in MB."""
    program = engine.programs.add(wasm, name="idle").hash
    process = psutil.Process()
    async with engine.requester("bench-idle") as requester:
        warm = await requester.launch(program, "")
        await trio.sleep(0.5)
        await warm.send(text="done")
        await warm.outcome()
        before = process.memory_info().rss
        runs = [await requester.launch(program, "") for _ in range(count)]
        await trio.sleep(1.0 + 0.05 * count)
        after = process.memory_info().rss
        for run in runs:
            await run.send(text="done")
            await run.outcome()
    return (after - before) / count / 2**20


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pie.drivers.loader import resolve_model
    from pie.drivers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(resolve_model(None))
    text_completion = cached_component(TEXT_COMPLETION)
    idle = component_from_source("idle", IDLE_SOURCE)
    driver_args = {"pass_seconds": args.pass_ms / 1000, "vocab_size": tokenizer.vocab_size}
    config = with_overrides(EngineConfig(), event_log={"enabled": False})
    figures: dict[str, Any] = {"pass_ms": args.pass_ms, "tokens": args.tokens}

    async def main() -> None:
        driver = SyntheticDriver(**driver_args)
        async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
            program = engine.programs.add(text_completion, name="text-completion").hash
            for concurrency in args.concurrency:
                before = engine.statistics()
                row = await _overhead(engine, program, concurrency, args)
                after = engine.statistics()
                requests = (
                    after.scheduler.requests
                    - before.scheduler.requests
                    + after.inference.lane_passes
                    - before.inference.lane_passes
                )
                passes = after.inference.passes - before.inference.passes
                row["mean_batch_size"] = requests / max(1, passes)
                figures[f"concurrency_{concurrency}"] = row
            figures["idle_rss_mb_per_inferlet"] = await _idle_memory(engine, idle, args.idle)
        figures.update(await _launch_latency(config, driver_args, tokenizer, text_completion))

    trio.run(main)
    return figures


def run_bench_inferlets(args: argparse.Namespace) -> int:
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"fixed forward pass: {args.pass_ms} ms; text-completion inferlet, greedy")
    print(
        f"{'concurrent':>10}{'us/token':>12}{'overhead us':>13}{'tokens/s':>11}{'ideal':>9}"
        f"{'batch':>7}"
    )
    for concurrency in args.concurrency:
        row = figures[f"concurrency_{concurrency}"]
        print(
            f"{concurrency:>10}{row['us_per_token']:>12.0f}{row['overhead_us_per_token']:>13.0f}"
            f"{row['tokens_per_second']:>11.1f}{row['ideal_tokens_per_second']:>9.0f}"
            f"{row['mean_batch_size']:>7.1f}"
        )
    print(
        f"cold launch (component from the disk cache) to result: {figures['cold_launch_ms']:.1f} ms"
    )
    print(f"warm launch to result: {figures['warm_launch_ms']:.1f} ms")
    print(f"resident memory per idle inferlet: {figures['idle_rss_mb_per_inferlet']:.1f} MB")
    return 0
