"""`pie bench tax`: the programmability tax, side by side at each speculation depth and in both
ways a program can generate.

A driver whose forward pass takes a fixed time T stands in for the model. In `run` mode the
text-completion inferlet generates (a generation run: the engine carries the loop); in `step`
mode an inferlet drives the same generation one pass at a time (`gen.step()`). Everything a
token costs beyond T is the runtime's: host calls, the guest's own Python, batching and
delivery; `host_us_per_token` is the process's CPU time per token. With a think time W the
stepping guest also busies itself for W per token, as an agent would. With --real the
configured model runs instead (T is then the mean time of its decode passes in that row), and
the engine's own decode of as many sequences at once (what `pie bench` measures) is measured
beside it for the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import attrs
import psutil
import trio

from pie.cli.bench.engine import concurrent_decode
from pie.cli.bench.inferlets import TEXT_COMPLETION, cached_component, component_from_source
from pie.config import with_overrides
from pie.dataplane import PassTimes
from pie.drivers.base import Driver
from pie.drivers.batch import ForwardBatch
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, EngineStatistics, open_engine
from pie.events.sampling import SlotOutput

STEP_SOURCE = '''"""text-completion's generation stepped one pass at a time, busy for `think_us`
after every token. With `busy_loop`, a timer stays set on the inferlet's event loop, so each
step takes three host calls (submit, poll, outputs) instead of one."""

import asyncio
import time

from inferlet import Context, Sampler, get_model


async def main(input):
    think = input.get("think_us", 0) / 1e6
    if input.get("busy_loop"):
        asyncio.get_running_loop().call_later(3600, lambda: None)
    with Context(get_model()) as ctx:
        ctx.user(input["prompt"]).cue()
        gen = ctx.generate(Sampler.argmax(), max_tokens=input["max_tokens"])
        while not gen.done:
            await gen.step()
            until = time.perf_counter() + think
            while time.perf_counter() < until:
                pass
        return len(gen.tokens)
'''


@attrs.frozen
class _Sample:
    at: float
    cpu: float
    stats: EngineStatistics


async def _steady(
    engine: Engine, program: str, mode: str, concurrency: int, args: argparse.Namespace
) -> tuple[_Sample, _Sample]:
    """Launches `concurrency` generations of `args.tokens` tokens at once and samples the
    engine while they run; the first and last samples taken while every one of them was
    decoding (all launched and prefilled, none finished), so launching, prefilling and
    finishing stay out of the rate."""
    driver = engine.driver
    assert isinstance(driver, _MeteredDriver)
    process = psutil.Process()
    fields = {"prompt": "Count with me.", "max_tokens": args.tokens, "temperature": 0}
    if args.think_us:
        fields["think_us"] = args.think_us
    if mode == "step-poll":
        fields["busy_loop"] = True
    request = json.dumps(fields)
    window: list[_Sample] = []
    failures: list[str] = []

    async def one() -> None:
        outcome = await engine.run_inferlet(program, request)
        if not outcome.ok:
            failures.append(outcome.error or outcome.status)

    fast = engine.config.scheduler.fast_path
    lanes_before = engine.statistics().speculation.leases

    def all_generating(stats: EngineStatistics) -> bool:
        # A lane opens once the pass that granted its lease has ended: the context's prefill
        # is done and it decodes on the lane. Without the fast path, having its context is the
        # best sign there is.
        if fast:
            started = stats.speculation.leases - lanes_before
        else:
            started = stats.kv.contexts
        return stats.inferlets.running == concurrency and started >= concurrency

    async def watch(done: trio.Event) -> None:
        while not done.is_set():
            stats = engine.statistics()
            if all_generating(stats):
                cpu = process.cpu_times()
                used = cpu.user + cpu.system - driver.cpu_seconds
                window.append(_Sample(at=time.perf_counter(), cpu=used, stats=stats))
            elif window:
                return
            # Sparse enough that the sampling itself costs the engine next to nothing.
            await trio.sleep(0.05)

    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, done)
        async with trio.open_nursery() as runs:
            for _ in range(concurrency):
                runs.start_soon(one)
        done.set()
    if failures:
        raise RuntimeError(f"a benchmark inferlet failed: {failures[0]}")
    if len(window) < 3:
        raise RuntimeError(
            f"the {concurrency} generations never ran all at once long enough to measure: "
            "give more --tokens"
        )
    return window[1], window[-1]


async def _row(
    engine: Engine, program: str, mode: str, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    driver = engine.driver
    assert isinstance(driver, _MeteredDriver)
    rates = []
    for _ in range(args.repeats):
        driver.take_decode_mean()  # only the window's passes count
        first, last = await _steady(engine, program, mode, concurrency, args)
        rates.append(_rates(first, last, concurrency))
    row = {k: statistics.median(r[k] for r in rates) for k in rates[0] if k != "pass_parts_us"}
    pass_seconds = args.pass_ms / 1000
    if args.real:
        pass_seconds = driver.take_decode_mean()
    wall = concurrency / row["tps"]
    return {
        **row,
        "ideal_tps": None if args.real else concurrency / pass_seconds,
        "overhead_us_per_token": (wall - pass_seconds) * 1e6,
        "us_per_token": wall * 1e6,
        "pass_ms": pass_seconds * 1e3,
        "pass_parts_us": rates[len(rates) // 2]["pass_parts_us"],
    }


def _rates(first: _Sample, last: _Sample, concurrency: int) -> dict[str, Any]:
    """Tokens per second, host CPU per token, hit rate, pass size and pass parts between two
    samples."""
    a, b = first.stats, last.stats
    # Tokens the programs received: on the fast path every decode is a lane pass a program
    # claimed (staged passes thrown away are left out); otherwise each is a placed request.
    served = b.speculation.hits + b.speculation.direct - a.speculation.hits - a.speculation.direct
    tokens = served or b.scheduler.requests - a.scheduler.requests
    passes = b.inference.passes - a.inference.passes
    hits = b.speculation.hits - a.speculation.hits
    settled = hits + b.speculation.wasted_passes - a.speculation.wasted_passes
    return {
        "tps": tokens / (last.at - first.at),
        "host_us_per_token": (last.cpu - first.cpu) * 1e6 / max(tokens, 1),
        "hit_rate": hits / settled if settled else 0.0,
        "mean_batch": (b.inference.tokens - a.inference.tokens) / passes if passes else 0.0,
        "pass_parts_us": _parts_per_pass(a.inference.pass_times, b.inference.pass_times, passes),
    }


def _parts_per_pass(before: PassTimes, after: PassTimes, passes: int) -> dict[str, float]:
    """Microseconds per pass in each part of the pass loop's work between two readings."""
    then, now = attrs.asdict(before), attrs.asdict(after)
    return {part: (now[part] - then[part]) * 1e6 / max(passes, 1) for part in now}


async def _rows(
    engine: Engine, programs: dict[str, bytes], concurrency: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One row per mode at this concurrency; on the model, with the ratio to the engine's own
    decode of as many sequences."""
    engine_tps = None
    if args.real:
        engine_tps, _ = await concurrent_decode(engine, concurrency, args.tokens)
    rows = []
    for mode in args.mode:
        program = engine.programs.add(programs[mode]).hash
        row = await _row(engine, program, mode, concurrency, args)
        if engine_tps:
            row["engine_decode_tps"] = engine_tps
            row["of_engine_decode"] = row["tps"] / engine_tps
        rows.append({"mode": mode, "concurrency": concurrency, **row})
    return rows


class _MeteredDriver:
    """A driver that counts the CPU time its forward passes take (the model's work, which
    `host_us_per_token` leaves out) and times its decode passes (one token per request: no
    prefill), whose mean stands for T when the model runs."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self.info = driver.info
        self._decode: list[float] = []
        self.cpu_seconds = 0.0

    def forward(self, batch: ForwardBatch) -> list[SlotOutput]:
        started, cpu = time.perf_counter(), time.thread_time()
        outputs = self._driver.forward(batch)
        self.cpu_seconds += time.thread_time() - cpu
        if batch.num_tokens == batch.num_requests:
            self._decode.append(time.perf_counter() - started)
        return outputs

    def take_decode_mean(self) -> float:
        decode, self._decode = self._decode, []
        return sum(decode) / len(decode) if decode else 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)


def _driver(args: argparse.Namespace, vocab_size: int) -> _MeteredDriver:
    width = _width(args)
    # Room for every generation's prompt and tokens at once, with a page of slack each.
    pages = width * ((args.tokens + 64) // 16 + 2)
    synthetic = SyntheticDriver(
        pass_seconds=args.pass_ms / 1000,
        vocab_size=vocab_size,
        max_batch_requests=width,
        max_batch_tokens=max(512, 2 * width),
        num_pages=max(4096, pages),
        keep_batches=False,
    )
    return _MeteredDriver(synthetic)


def _width(args: argparse.Namespace) -> int:
    """Passes as wide as the most inferlets measured at once (at least the defaults), and as
    many of them running: the ideal is then every inferlet's token in every pass."""
    return max(64, *args.concurrency)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pie.cli.options import engine_config
    from pie.drivers.loader import resolve_model
    from pie.drivers.tokenizer import Tokenizer

    width = _width(args)
    base = with_overrides(
        engine_config(args),
        event_log={"enabled": False},
        scheduler={"max_batch_requests": width, "max_batch_tokens": max(512, 2 * width)},
        # Every generation admitted at once: text-completion needs a few tens of MiB, so the
        # caps are small and the guests' memory budget holds all of them.
        sandbox={"max_concurrent": width, "memory_mb": 64, "guest_memory_mb": width * 64},
    )
    stepped = component_from_source("stepped", STEP_SOURCE)
    programs = {"run": cached_component(TEXT_COMPLETION), "step": stepped, "step-poll": stepped}
    rows: list[dict[str, Any]] = []
    settings: list[tuple[int | None, dict[str, Any]]] = [
        (depth, {"speculation_depth": depth}) for depth in args.depths
    ]
    if args.slow_path:
        settings.insert(0, (None, {"fast_path": False}))

    async def main() -> None:
        real: tuple[Any, Any] | None = None
        tokenizer = None
        if args.real:
            from pie.drivers.threads import set_wait_policy

            set_wait_policy(base.driver)  # before the factory's imports load torch
            from pie.drivers.factory import build_torch_driver

            torch_driver, tokenizer = await trio.to_thread.run_sync(build_torch_driver, base)
            real = (_MeteredDriver(torch_driver), tokenizer)
        else:
            tokenizer = Tokenizer.from_folder(resolve_model(base.model.path or None))
        for depth, scheduler in settings:
            config = with_overrides(base, scheduler=scheduler)
            driver: Any
            if real is not None:
                driver, tokenizer = real
            else:
                assert tokenizer is not None
                driver = _driver(args, tokenizer.vocab_size)
            async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
                for concurrency in args.concurrency:
                    for row in await _rows(engine, programs, concurrency, args):
                        rows.append({"depth": depth, **row})
                        _progress(rows[-1])

    trio.run(main)
    return rows


def _progress(row: dict[str, Any]) -> None:
    import sys

    print(
        f"  depth {row['depth']}, {row['mode']}, {row['concurrency']} inferlets: "
        f"{row['tps']:.1f} tokens/s",
        file=sys.stderr,
    )


def run_bench_tax(args: argparse.Namespace) -> int:
    rows = measure(args)
    if args.json:
        print(json.dumps({"pass_ms": args.pass_ms, "think_us": args.think_us, "rows": rows}))
        return 0
    what = "the configured model" if args.real else f"a fixed {args.pass_ms} ms forward pass"
    print(f"{what}; text-completion's generation, greedy; think time {args.think_us} us/token")
    print(
        f"{'depth':>6}{'mode':>6}{'inferlets':>10}{'tokens/s':>11}{'ideal':>9}"
        f"{'overhead us':>13}{'host us':>9}{'hit rate':>10}{'batch':>7}"
        + (f"{'of engine':>11}" if args.real else "")
    )
    for row in rows:
        depth = "off" if row["depth"] is None else str(row["depth"])
        ideal = "-" if row["ideal_tps"] is None else f"{row['ideal_tps']:.0f}"
        ratio = f"{row['of_engine_decode']:>11.1%}" if "of_engine_decode" in row else ""
        print(
            f"{depth:>6}{row['mode']:>6}{row['concurrency']:>10}{row['tps']:>11.1f}{ideal:>9}"
            f"{row['overhead_us_per_token']:>13.0f}{row['host_us_per_token']:>9.0f}"
            f"{row['hit_rate']:>10.1%}{row['mean_batch']:>7.1f}{ratio}"
        )
    return 0
