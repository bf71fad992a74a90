"""What the event log costs: text-completion's generate loop on a driver whose pass takes a fixed
time, with the log off, in memory only, writing its file (encoded in a child process, `file`, or
on the writer thread, `thread`), and writing its file inline on the Trio thread (each envelope
encoded and written at delivery: the writer as it first was, for comparison).

One engine runs every mode, swapping its log between runs, in a different order each round, so
that a slow drift in what else the machine runs touches every mode alike. For throughput and
for the CPU time per token of the Trio thread, the writer thread and the whole process, the
tables show the median and range of the rounds, and the change from the first mode.

    .venv/bin/python scripts/bench_event_log.py --rounds 3 --concurrency 1 16 64
    .venv/bin/python scripts/bench_event_log.py --micro     # appends alone, no engine
    .venv/bin/python scripts/bench_event_log.py --critical  # a pass loop alone, no engine
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import trio

from pie.cli.bench.inferlets import TEXT_COMPLETION, cached_component
from pie.config import EngineConfig, with_overrides
from pie.drivers.loader import resolve_model
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import open_engine
from pie.eventlog import Envelope, EventLog
from pie.eventlog.records import correlation_of
from pie.events import codec

MODES = ("off", "ring", "file", "thread", "inline")


class InlineEventLog(EventLog):
    """The ring, plus each envelope encoded and written to the file by the appender itself."""

    def __init__(self, *, ring_size: int = 100_000, path: str | Path | None = None, **_: Any):
        super().__init__(ring_size=ring_size)
        self._inline: IO[str] | None = open(path, "w", encoding="utf-8") if path else None

    def append(self, src: str, dst: str, event: Any) -> int:
        seq = super().append(src, dst, event)
        if self._inline is not None:
            # What the appender used to do for each record: build the envelope, encode, write.
            envelope = Envelope(
                seq=seq, time=time.time(), src=src, dst=dst, corr=correlation_of(event), event=event
            )
            record = {
                "seq": envelope.seq,
                "time": envelope.time,
                "src": envelope.src,
                "dst": envelope.dst,
                "corr": envelope.corr,
                "event": codec.encode(envelope.event),
            }
            self._inline.write(json.dumps(record, separators=(",", ":")) + "\n")
        return seq

    def close(self) -> None:
        super().close()
        if self._inline is not None:
            self._inline.close()
            self._inline = None


def _log(mode: str, path: Path) -> EventLog | None:
    if mode == "off":
        return None
    if mode == "ring":
        return EventLog()
    if mode == "thread":
        return EventLog(path=path, encoder="thread")
    return (InlineEventLog if mode == "inline" else EventLog)(path=path)


METRICS = {
    "tps": "tokens/s",
    "trio_us": "Trio thread CPU us per token",
    "writer_us": "log writer thread CPU us per token",
    "cpu_us": "process CPU us per token (every thread: guests, driver, writer)",
}
Results = dict[str, dict[str, dict[int, list[float]]]]
"""metric -> mode -> concurrency -> one value per round."""


async def _generate(engine: Any, program: str, concurrency: int, tokens: int) -> float:
    """Wall time of `concurrency` greedy completions of `tokens` tokens, run at once."""
    request = json.dumps({"prompt": "Count with me.", "max_tokens": tokens, "temperature": 0})
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(engine.run_inferlet, program, request)
    return time.perf_counter() - started


def _writer_clock() -> Any:
    """The CPU clock of the engine's log writer thread, or None without one."""
    writer = next((t for t in threading.enumerate() if t.name == "pie-event-log"), None)
    if writer is None or writer.ident is None:
        return lambda: 0.0
    clock = time.pthread_getcpuclockid(writer.ident)
    return lambda: time.clock_gettime(clock)


async def _run(engine: Any, program: str, concurrency: int, mode: str, tokens: int) -> dict:
    """One run of `concurrency` completions with the log of `mode`: its throughput (launch and
    prompt included, the same in every mode) and the CPU time each thread spent per token."""
    with tempfile.TemporaryDirectory() as scratch:
        log = _log(mode, Path(scratch) / "events.jsonl")
        engine.router.log = log
        writer = _writer_clock()
        before = time.thread_time(), writer(), time.process_time()
        wall = await _generate(engine, program, concurrency, tokens)
        if log is not None:
            log.flush()  # the writer's share of this run, before its clock stops with it
        after = time.thread_time(), writer(), time.process_time()
        engine.router.log = None
        if log is not None:
            log.close()
    generated = concurrency * tokens
    trio_us, writer_us, cpu_us = (
        (b - a) / generated * 1e6 for a, b in zip(before, after, strict=True)
    )
    return {
        "tps": generated / wall,
        "trio_us": trio_us,
        "writer_us": writer_us,
        "cpu_us": cpu_us,
    }


def measure(args: argparse.Namespace) -> Results:
    tokenizer = Tokenizer.from_folder(resolve_model(None))
    wasm = cached_component(TEXT_COMPLETION)
    results: Results = {
        metric: {mode: {c: [] for c in args.concurrency} for mode in args.modes}
        for metric in METRICS
    }
    config = with_overrides(EngineConfig(), event_log={"enabled": False})

    async def main() -> None:
        driver = SyntheticDriver(pass_seconds=args.pass_ms / 1000, vocab_size=tokenizer.vocab_size)
        async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
            program = engine.programs.add(wasm).hash
            for concurrency in args.concurrency:
                await _generate(engine, program, concurrency, 4)
                for round_ in range(args.rounds):
                    shift = round_ % len(args.modes)
                    for mode in args.modes[shift:] + args.modes[:shift]:
                        row = await _run(engine, program, concurrency, mode, args.tokens)
                        for metric, value in row.items():
                            results[metric][mode][concurrency].append(value)
                        print(
                            f"{concurrency} inferlets, round {round_ + 1}, {mode:>6}: "
                            f"{row['tps']:.0f} tok/s, CPU us/token trio {row['trio_us']:.0f} "
                            f"writer {row['writer_us']:.1f} all {row['cpu_us']:.0f}",
                            file=sys.stderr,
                        )

    trio.run(main)
    return results


def report(results: Results, args: argparse.Namespace) -> None:
    for metric, title in METRICS.items():
        print(f"{title}, fixed {args.pass_ms} ms pass, {args.rounds} rounds: median [min-max]")
        print(f"{'inferlets':>9} " + " ".join(f"{m:>27}" for m in args.modes))
        for concurrency in args.concurrency:
            base = statistics.median(results[metric][args.modes[0]][concurrency])
            cells = []
            for mode in args.modes:
                values = results[metric][mode][concurrency]
                median = statistics.median(values)
                change = f"{(median / base - 1) * 100:+5.1f}%" if base else ""
                cells.append(f"{median:7.1f} [{min(values):.1f}-{max(values):.1f}] {change}")
            print(f"{concurrency:>9} " + " ".join(f"{cell:>27}" for cell in cells))
        print()
    base_mode = args.modes[0]
    print(f"tokens/s change from {base_mode!r} within each round: median [min-max]")
    print(f"{'inferlets':>9} " + " ".join(f"{m:>27}" for m in args.modes[1:]))
    for concurrency in args.concurrency:
        base = results["tps"][base_mode][concurrency]
        cells = []
        for mode in args.modes[1:]:
            changes = [
                (value / before - 1) * 100
                for value, before in zip(results["tps"][mode][concurrency], base, strict=True)
            ]
            median = statistics.median(changes)
            cells.append(f"{median:+6.1f}% [{min(changes):+.1f} to {max(changes):+.1f}]")
        print(f"{concurrency:>9} " + " ".join(f"{cell:>27}" for cell in cells))


def _lane_events(count: int) -> list[Any]:
    """Per-token records: a token handed to a program on the fast path."""
    from pie.events.sampling import TokenOutput
    from pie.events.speculation import LanePassApplied

    return [
        LanePassApplied(
            lease=1,
            context=2,
            corr=i,
            token=i % 50_000,
            position=i,
            page=3,
            staged=True,
            outputs=(TokenOutput(token=i % 50_000),),
        )
        for i in range(count)
    ]


def _children_cpu() -> float:
    """CPU seconds of the child processes ended and waited for so far (the encoder's)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def micro(args: argparse.Namespace) -> None:
    """The appender's own cost per record (its thread's CPU time), everything the log costs the
    engine's process per record until the file is closed (the process's CPU time, the writer's
    included), and what the encoder process took."""
    count = 200_000
    events = _lane_events(count)
    print(f"{count} appends, {args.rounds} rounds: median [min-max] us/record")
    print(f"{'mode':>8} {'appender':>22} {'engine process':>22} {'encoder process':>22}")
    for mode in ("ring", "file", "thread", "inline"):
        appender, whole, child = [], [], []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as scratch:
                log = _log(mode, Path(scratch) / "events.jsonl")
                assert log is not None
                thread, cpu, children = time.thread_time(), time.process_time(), _children_cpu()
                for event in events:
                    log.append("inference", "kv", event)
                appender.append((time.thread_time() - thread) / count * 1e6)
                log.close()
                whole.append((time.process_time() - cpu) / count * 1e6)
                child.append((_children_cpu() - children) / count * 1e6)
        cells = [
            f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
            for v in (appender, whole, child)
        ]
        print(f"{mode:>8} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22}")


def critical(args: argparse.Namespace) -> None:
    """The critical path alone: a pass of `pass_ms` on another thread, then the Trio thread logs
    what the pass produced; what each mode adds to a pass, with no guests to blur it."""
    passes = 200

    async def one(mode: str, events: list[Any]) -> float:
        with tempfile.TemporaryDirectory() as scratch:
            log = _log(mode, Path(scratch) / "events.jsonl")
            started = time.perf_counter()
            for _ in range(passes):
                await trio.to_thread.run_sync(time.sleep, args.pass_ms / 1000)
                if log is not None:
                    for event in events:
                        log.append("inference", "kv", event)
            wall = time.perf_counter() - started
            if log is not None:
                log.close()
        return (wall / passes - args.pass_ms / 1000) * 1e6

    async def main() -> None:
        modes = list(args.modes)
        print(f"us a pass takes beyond {args.pass_ms} ms, {args.rounds} rounds: median [min-max]")
        print(f"{'records':>8} " + " ".join(f"{m:>20}" for m in modes))
        for count in args.records:
            events = _lane_events(count)
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for round_ in range(args.rounds):
                shift = round_ % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    times[mode].append(await one(mode, events))
            cells = [
                f"{statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]" for v in times.values()
            ]
            print(f"{count:>8} " + " ".join(f"{cell:>20}" for cell in cells))

    trio.run(main)


def collect(args: argparse.Namespace) -> None:
    """What a full pass of the cyclic garbage collector costs with the engine's imports loaded,
    then with the ring full of one pass's records per row (16 lanes each), then with the
    start-up heap frozen as `pie serve` freezes it (pie/engine/heap.py), then once a quarter
    of the ring was made again. Rows are measured once they have been through a few
    collections, as in a running engine (the first ones untrack the ring's nested tuples)."""
    import gc

    import pie.engine  # noqa: F401  (the start-up heap: torch, wasmtime, the engine)
    from pie.engine.heap import settle_heap
    from pie.events.speculation import LanePassesApplied

    def full_pass() -> float:
        for _ in range(5):
            gc.collect()
        times = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            gc.collect()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    def fill(log: EventLog, rows: int) -> None:
        for i in range(rows):
            log.append("inference", "kv", LanePassesApplied(passes=tuple(_lane_events(16))), i)

    print(f"a full collection, median of {args.rounds}: {full_pass():.1f} ms with the imports")
    log = EventLog(ring_size=args.ring)
    fill(log, args.ring)
    print(f"  {full_pass():.1f} ms with the ring full ({args.ring} rows of 16 lane passes)")
    settle_heap()
    print(f"  {full_pass():.1f} ms with all of that frozen (settle_heap)")
    fill(log, args.ring // 4)
    print(f"  {full_pass():.1f} ms after a quarter of the ring was made again")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pass-ms", type=float, default=5.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--micro", action="store_true", help="time appends alone, no engine")
    parser.add_argument("--critical", action="store_true", help="a pass loop alone, no engine")
    parser.add_argument("--records", type=int, nargs="+", default=[64, 160])
    parser.add_argument("--collect", action="store_true", help="garbage collector pauses")
    parser.add_argument("--ring", type=int, default=100_000, help="rows, for --collect")
    args = parser.parse_args()
    if args.collect:
        collect(args)
        return 0
    if args.micro:
        micro(args)
        return 0
    if args.critical:
        critical(args)
        return 0
    results = measure(args)
    if args.json:
        print(json.dumps(results))
    else:
        report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
