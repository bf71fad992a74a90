"""Python function calls per token that each setting of the event log costs, counted rather than
timed, over the stepping programs of `pie bench log`: a count does not move with the machine's
load, so it shows what a setting adds where a timing on a shared machine cannot. The calls of
every thread are counted while the programs step (a profile hook slows the run down several
times, which can shift the batching a little, not what a token costs).

    .venv/bin/python scripts/count_log_calls.py --tokens 256 --top 15
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import trio

from pie.cli.bench.eventlog import SETTINGS
from pie.cli.bench.inferlets import component_from_source
from pie.cli.bench.tax import STEP_SOURCE, _driver, _row
from pie.config import EngineConfig, with_overrides
from pie.drivers.loader import resolve_model
from pie.drivers.tokenizer import Tokenizer
from pie.engine import open_engine
from pie.engine.heap import release_heap

Counts = collections.Counter[str]

LOGGING = ("pie/eventlog/", "pie/events/codec.py", "cattrs/", "json/", "pie/sandbox/recording.py")
LOGGING += ("pie/sandbox/callvalues.py", "pie/actors/inferlet/recording.py", "<packer of ")
"""Where the log's own work runs: the calls made there are what a setting adds for certain,
while the whole process's count also moves with how often its threads happened to poll."""


def count(setting: str, args: argparse.Namespace, folder: str) -> Counts:
    """Every Python call made while `args.concurrency` programs step `args.tokens` tokens."""
    width = max(64, args.concurrency)
    log = {k: v.format(folder=folder) if isinstance(v, str) else v
           for k, v in SETTINGS[setting].items()}  # fmt: skip
    config = with_overrides(
        EngineConfig(),
        event_log=log,
        scheduler={"max_batch_requests": width, "max_batch_tokens": max(512, 2 * width)},
        sandbox={"max_concurrent": width, "memory_mb": 64, "guest_memory_mb": width * 64},
    )
    tokenizer = Tokenizer.from_folder(resolve_model(None))
    stepped = component_from_source("stepped", STEP_SOURCE)
    shaped = argparse.Namespace(
        repeats=1, tokens=args.tokens, think_us=0.0, pass_ms=5.0, real=False, concurrency=[width]
    )
    calls: Counts = collections.Counter()
    counting = threading.Event()

    def hook(frame: FrameType, event: str, _: Any) -> None:
        if event == "call" and counting.is_set():
            code = frame.f_code
            calls[f"{code.co_filename.rpartition('site-packages/')[2]}:{code.co_name}"] += 1

    async def run() -> None:
        driver = _driver(shaped, tokenizer.vocab_size)
        async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
            program = engine.programs.add(stepped).hash
            counting.set()
            try:
                await _row(engine, program, "step", args.concurrency, shaped)
            finally:
                counting.clear()

    # Hooked before the engine starts its threads (the log's writer among them): a thread
    # takes threading's hook when it starts.
    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        trio.run(run)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    release_heap()
    Path(folder, "events.jsonl").unlink(missing_ok=True)
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens each program steps")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--top", type=int, default=10, help="functions listed per setting")
    parser.add_argument(
        "--own", type=int, default=0, help="also list the log's own functions with most calls"
    )
    args = parser.parse_args()
    tokens = args.tokens * args.concurrency
    with tempfile.TemporaryDirectory(prefix="pie-count-calls-") as folder:
        counted = {setting: count(setting, args, folder) for setting in args.settings}
    base = counted.get("off")
    for setting, calls in counted.items():
        own = sum(n for name, n in calls.items() if any(part in name for part in LOGGING))
        line = f"{setting:>8}: {calls.total() / tokens:7.1f} Python calls a token, "
        line += f"{own / tokens:5.1f} of them in the log's code"
        if base is not None and setting != "off":
            line += f" ({(calls.total() - base.total()) / tokens:+.1f} against off)"
        print(line)
        if base is not None and setting != "off" and args.top:
            added = calls.copy()
            added.subtract(base)
            for name, extra in added.most_common(args.top):
                print(f"          {extra / tokens:+6.2f}  {name}")
        if args.own:
            mine = collections.Counter(
                {name: n for name, n in calls.items() if any(p in name for p in LOGGING)}
            )
            for name, n in mine.most_common(args.own):
                print(f"           {n / tokens:6.2f}  {name}  (the log's own)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
