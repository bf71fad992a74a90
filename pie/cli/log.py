"""The bodies of `pie log` (an event log printed readably) and `pie replay` (an actor's recorded
inputs folded again through its core and checked against its recorded outputs)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pie.events import codec


def run_log(args: argparse.Namespace) -> int:
    from pie.eventlog import Gap, read_entries

    shown = 0
    for env in read_entries(args.file):
        if isinstance(env, Gap):
            print(
                f"{'':>7} {env.count} records not in the file (seq {env.first} to {env.last}): "
                f"{env.reason}"
            )
            continue
        if args.actor and args.actor not in (env.src, env.dst):
            continue
        if args.corr is not None and env.corr != args.corr:
            continue
        corr = "-" if env.corr is None else str(env.corr)
        print(
            f"{env.seq:>7} {env.time:.6f} {env.src:>12} -> {env.dst:<12} {corr:>6}  "
            f"{_describe(env.event)}"
        )
        shown += 1
        if args.limit and shown >= args.limit:
            break
    return 0


def _describe(event: Any) -> str:
    data = codec.encode(event)
    name = data.pop(codec.TAG)
    data.pop("corr", None)
    text = json.dumps(data, separators=(",", ":"))
    return f"{name} {text if len(text) <= 160 else text[:157] + '...'}"


def run_replay(args: argparse.Namespace) -> int:
    if getattr(args, "inferlet", None):
        from pie.cli.replay_inferlet import run_inferlet_replay

        return run_inferlet_replay(args)
    from pie.actors.kv import KvCore
    from pie.eventlog import LogGap, read_log
    from pie.eventlog.replay import replay
    from pie.events.batching import EngineStarted

    try:
        envelopes = list(read_log(args.file))
    except LogGap as gap:
        print(f"pie: cannot replay an incomplete log: {gap}", file=sys.stderr)
        return 2
    started = next((e.event for e in envelopes if isinstance(e.event, EngineStarted)), None)
    if started is None:
        print("pie: the log has no EngineStarted record", file=sys.stderr)
        return 2
    core = KvCore(
        num_pages=started.num_pages,
        page_size=started.page_size,
        vocab_size=started.vocab_size,
        prefix_cache=started.prefix_cache,
        sliding_window=started.sliding_window,
        adapters=started.adapters,
    )
    result = replay(envelopes, args.actor, core)
    stats = core.statistics()
    print(
        f"replayed {result.inputs} inputs to {args.actor!r}: {result.outputs} outputs, "
        f"{len(result.mismatches)} mismatches; "
        f"final pages free {stats.pages_free}/{stats.pages_total}, "
        f"contexts {stats.contexts}, snapshots {stats.snapshots}"
    )
    for line in result.mismatches[:20]:
        print(f"  {line}")
    return 0 if result.exact else 1
