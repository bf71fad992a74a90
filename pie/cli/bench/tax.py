"""`pie bench tax`: the programmability tax, side by side at each speculation depth.

A driver whose forward pass takes a fixed time T stands in for the model, and the
text-completion inferlet's generate loop runs at several concurrencies. Everything a token
costs beyond T is the runtime's: host calls, the guest's own Python, batching and delivery.
With a think time W the guest also busies itself for W per token, as an agent would.
With --real the configured model runs instead (T is then the mean time of its decode passes
in that row).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import trio

from pie.cli.bench.inferlets import (
    TEXT_COMPLETION,
    cached_component,
    component_from_source,
    per_token_seconds,
)
from pie.config import with_overrides
from pie.drivers.base import Driver
from pie.drivers.batch import ForwardBatch
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.events.sampling import SlotOutput

THINK_SOURCE = '''"""text-completion's generate loop, busy for `think_us` after every token."""

import time

from inferlet import Context, Sampler, get_model


async def main(input):
    think = input["think_us"] / 1e6
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


async def _row(
    engine: Engine, program: str, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    before = engine.statistics()
    wall = await per_token_seconds(
        engine,
        program,
        concurrency,
        tokens=args.tokens,
        repeats=args.repeats,
        extra={"think_us": args.think_us} if args.think_us else None,
    )
    after = engine.statistics()
    passes = after.inference.passes - before.inference.passes
    pass_seconds = args.pass_ms / 1000
    if isinstance(engine.driver, _TimedDriver):
        pass_seconds = engine.driver.take_decode_mean()
    spec, old = after.speculation, before.speculation
    hits = spec.hits - old.hits
    settled = hits + spec.wasted_passes - old.wasted_passes
    return {
        "tps": concurrency / wall,
        "ideal_tps": None if args.real else concurrency / pass_seconds,
        "overhead_us_per_token": (wall - pass_seconds) * 1e6,
        "hit_rate": hits / settled if settled else 0.0,
        "us_per_token": wall * 1e6,
        "pass_ms": pass_seconds * 1e3,
        "mean_batch": (
            (
                after.inference.lane_passes
                - before.inference.lane_passes
                + after.scheduler.requests
                - before.scheduler.requests
            )
            / passes
            if passes
            else 0.0
        ),
    }


class _TimedDriver:
    """The real driver, timing its decode passes (one token per request: no prefill), whose
    mean stands for T when the model runs."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self.info = driver.info
        self._decode: list[float] = []

    def forward(self, batch: ForwardBatch) -> list[SlotOutput]:
        started = time.perf_counter()
        outputs = self._driver.forward(batch)
        if batch.num_tokens == batch.num_requests:
            self._decode.append(time.perf_counter() - started)
        return outputs

    def take_decode_mean(self) -> float:
        decode, self._decode = self._decode, []
        return sum(decode) / len(decode) if decode else 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)


def _driver(args: argparse.Namespace, vocab_size: int) -> Driver:
    return SyntheticDriver(pass_seconds=args.pass_ms / 1000, vocab_size=vocab_size)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pie.cli.options import engine_config
    from pie.drivers.loader import resolve_model
    from pie.drivers.tokenizer import Tokenizer

    base = with_overrides(engine_config(args), event_log={"enabled": False})
    wasm = (
        component_from_source("think", THINK_SOURCE)
        if args.think_us
        else cached_component(TEXT_COMPLETION)
    )
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
            real = (_TimedDriver(torch_driver), tokenizer)
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
                program = engine.programs.add(wasm).hash
                for concurrency in args.concurrency:
                    row = await _row(engine, program, concurrency, args)
                    rows.append({"depth": depth, "concurrency": concurrency, **row})
                    _progress(rows[-1])

    trio.run(main)
    return rows


def _progress(row: dict[str, Any]) -> None:
    import sys

    print(
        f"  depth {row['depth']}, {row['concurrency']} inferlets: {row['tps']:.1f} tokens/s",
        file=sys.stderr,
    )


def run_bench_tax(args: argparse.Namespace) -> int:
    rows = measure(args)
    if args.json:
        print(json.dumps({"pass_ms": args.pass_ms, "think_us": args.think_us, "rows": rows}))
        return 0
    what = "the configured model" if args.real else f"a fixed {args.pass_ms} ms forward pass"
    print(f"{what}; text-completion's generate loop, greedy; think time {args.think_us} us/token")
    print(
        f"{'depth':>6}{'inferlets':>10}{'tokens/s':>11}{'ideal':>9}{'overhead us':>13}"
        f"{'hit rate':>10}{'batch':>7}"
    )
    for row in rows:
        depth = "off" if row["depth"] is None else str(row["depth"])
        ideal = "-" if row["ideal_tps"] is None else f"{row['ideal_tps']:.0f}"
        print(
            f"{depth:>6}{row['concurrency']:>10}{row['tps']:>11.1f}{ideal:>9}"
            f"{row['overhead_us_per_token']:>13.0f}{row['hit_rate']:>10.1%}"
            f"{row['mean_batch']:>7.1f}"
        )
    return 0
