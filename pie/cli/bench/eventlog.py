"""`pie bench log`: what writing the event log costs decode throughput, side by side with the
log off. Inferlets decode on a forward pass of fixed time (as in `pie bench tax`), stepping one
pass at a time (the most deliveries per token), and each setting runs in turn, repeats
interleaved, each in a fresh engine."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from pie.cli.bench import spread
from pie.cli.bench.inferlets import component_from_source
from pie.cli.bench.tax import STEP_SOURCE, _driver, _row
from pie.config import EngineConfig, with_overrides
from pie.engine import open_engine
from pie.engine.heap import release_heap, settle_heap

SETTINGS: dict[str, dict[str, Any]] = {
    "off": {"enabled": False},
    "ring": {"enabled": True},
    "file": {"enabled": True, "path": "{folder}/events.jsonl"},
    "record": {"enabled": True, "path": "{folder}/events.jsonl", "record_inferlets": True},
}
"""The event log as each setting configures it: off, the in-memory ring only, the ring and a
JSON-lines file, and the file with every host call of every inferlet recorded."""
for _name in ("file", "record"):
    SETTINGS[f"{_name}-thread"] = {**SETTINGS[_name], "encoder": "thread"}
"""`file-thread` and `record-thread`: the file encoded on the writer thread, in the engine's
process, rather than by the encoder process."""


def measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Tokens per second and host CPU microseconds per token of each setting, one pair per
    repeat."""
    from pie.cli.options import engine_config
    from pie.drivers.loader import resolve_model
    from pie.drivers.tokenizer import Tokenizer

    width = max(64, args.concurrency)
    base = with_overrides(
        engine_config(args),
        scheduler={"max_batch_requests": width, "max_batch_tokens": max(512, 2 * width)},
        sandbox={"max_concurrent": width, "memory_mb": 64, "guest_memory_mb": width * 64},
    )
    tokenizer = Tokenizer.from_folder(resolve_model(base.model.path or None))
    stepped = component_from_source("stepped", STEP_SOURCE)
    shaped = argparse.Namespace(
        repeats=1, tokens=args.tokens, think_us=0.0, pass_ms=args.pass_ms, real=False,
        concurrency=[width],
    )  # fmt: skip
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in args.settings}

    async def one(config: EngineConfig) -> tuple[float, float]:
        driver = _driver(shaped, tokenizer.vocab_size)
        async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
            program = engine.programs.add(stepped).hash
            settle_heap()  # as `pie serve` does once it is up
            row = await _row(engine, program, "step", args.concurrency, shaped)
        return float(row["tps"]), float(row["host_us_per_token"])

    with tempfile.TemporaryDirectory(prefix="pie-bench-log-") as folder:
        for repeat in range(args.repeats):
            # Alternating order, so that no setting always runs first on a warming machine.
            order = args.settings if repeat % 2 == 0 else list(reversed(args.settings))
            for name in order:
                log = {k: v.format(folder=folder) if isinstance(v, str) else v
                       for k, v in SETTINGS[name].items()}  # fmt: skip
                tps, cpu = trio.run(one, with_overrides(base, event_log=log))
                release_heap()  # the next engine starts without this one's frozen cycles
                rates[name].append((tps, cpu))
                print(
                    f"  {name}, repeat {repeat + 1}: {tps:.1f} tokens/s, {cpu:.1f} us of host "
                    "CPU a token",
                    file=sys.stderr,
                )
                Path(folder, "events.jsonl").unlink(missing_ok=True)
    return rates


def summary(rates: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """Each setting's tokens/s and host CPU per token, and their ratios to the log off, repeat
    by repeat (median and range). The CPU is the steadier measure on a shared machine; the
    throughput is what the log's cost is judged by."""
    base = rates.get("off")
    out: dict[str, Any] = {}
    for name, pairs in rates.items():
        tps, cpu = [p[0] for p in pairs], [p[1] for p in pairs]
        row: dict[str, Any] = {"tps": spread(tps), "host_us_per_token": spread(cpu)}
        if base and name != "off":
            row["of_off"] = spread([v / b[0] for v, b in zip(tps, base, strict=True)])
            row["cpu_of_off"] = spread([v / b[1] for v, b in zip(cpu, base, strict=True)])
        out[name] = row
    return out


def run_bench_log(args: argparse.Namespace) -> int:
    result = summary(measure(args))
    if args.json:
        print(json.dumps({"concurrency": args.concurrency, "pass_ms": args.pass_ms, **result}))
        return 0
    print(
        f"{args.concurrency} inferlets stepping {args.tokens} tokens each on a fixed "
        f"{args.pass_ms} ms pass; {args.repeats} repeats, interleaved"
    )
    print(f"{'log':>8}{'tokens/s':>12}{'range':>18}{'of off':>9}{'range':>16}", end="")
    print(f"{'CPU us/token':>14}{'of off':>9}{'range':>16}")
    for name, row in result.items():
        tps, ratio = row["tps"], row.get("of_off")
        line = f"{name:>8}{tps['median']:>12.1f}   {tps['min']:>7.1f}-{tps['max']:<7.1f}"
        line += _ratio(ratio) + f"{row['host_us_per_token']['median']:>14.1f}"
        print(line + _ratio(row.get("cpu_of_off")))
    if "off" in result:
        print("median ratios below 1 are the log's cost; " + _verdict(result))
    return 0


def _ratio(ratio: dict[str, float] | None) -> str:
    if ratio is None:
        return " " * 25
    return f"{ratio['median']:>9.3f}   {ratio['min']:.3f}-{ratio['max']:.3f}"


def _verdict(result: dict[str, Any]) -> str:
    worst = min(
        (row["of_off"]["median"] for row in result.values() if "of_off" in row), default=1.0
    )
    return f"the costliest setting takes {max(0.0, 1 - worst) * 100:.1f} % of decode throughput"
