"""The bodies of `pie log` (an event log printed readably) and `pie replay` (an actor's recorded
inputs folded again through its core and checked against its recorded outputs)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from pie.events import codec


def run_log(args: argparse.Namespace) -> int:
    from pie.eventlog import Gap, read_entries

    if args.tree is not None:
        return _print_tree(args)
    shown = 0
    for env in _readable(read_entries(args.file), args.file):
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
        print(_line(env))
        shown += 1
        if args.limit and shown >= args.limit:
            break
    return 0


def _print_tree(args: argparse.Namespace) -> int:
    """The causal tree of delivery `--tree SEQ` (with `--root`, of the first delivery in its
    chain of causes): each delivery indented under the one that caused it."""
    from pie.eventlog import Envelope, read_entries
    from pie.eventlog.tree import causal_tree, root_of

    envelopes = [env for env in read_entries(args.file) if isinstance(env, Envelope)]
    try:
        root = root_of(envelopes, args.tree) if args.root else args.tree
        shown = 0
        for depth, env in causal_tree(envelopes, root):
            # Depth is printed, and indentation capped, for chains thousands of passes long.
            print(f"{'  ' * min(depth, 16)}[{depth}] {_line(env)}")
            shown += 1
            if args.limit and shown >= args.limit:
                break
    except KeyError as missing:
        print(f"pie: {missing.args[0]}", file=sys.stderr)
        return 2
    return 0


def _line(env: Any) -> str:
    corr = "-" if env.corr is None else str(env.corr)
    return (
        f"{env.seq:>7} {env.time:.6f} {env.src:>12} -> {env.dst:<12} {corr:>6}  "
        f"{_describe(env.event)}"
    )


def _readable(entries: Iterable[Any], path: str) -> Iterator[Any]:
    """The file's entries; a record of the wrong shape is the file's fault (a ValueError that
    names it), not pie's."""
    read = 0
    try:
        for entry in entries:
            read += 1
            yield entry
    except (KeyError, TypeError, AttributeError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else f"a bad field ({exc})"
        raise ValueError(
            f"{path} is not an event log: a record after {read} good ones has {what}"
        ) from exc


def _describe(event: Any) -> str:
    data = codec.encode(event)
    name = data.pop(codec.TAG)
    data.pop("corr", None)
    text = json.dumps(data, separators=(",", ":"))
    return f"{name} {text if len(text) <= 160 else text[:157] + '...'}"


def run_replay(args: argparse.Namespace) -> int:
    """Replays every pure core (or those of `--actor`) and reports each by name: exit 0 when
    all are exact, 1 on a mismatch, 2 when the log cannot be replayed. With `--inferlet`, runs
    one recorded program again instead."""
    if args.inferlet:
        from pie.cli.replay_inferlet import run_inferlet_replay

        return run_inferlet_replay(args)
    from pie.engine.replay import NotReplayable, replay_cores
    from pie.eventlog import LogGap, read_log

    try:
        replays = replay_cores(_readable(read_log(args.file), args.file), args.actor)
    except LogGap as gap:
        print(f"pie: cannot replay an incomplete log: {gap}", file=sys.stderr)
        return 2
    except NotReplayable as missing:
        print(f"pie: {missing}", file=sys.stderr)
        return 2
    for done in replays:
        result = done.result
        verdict = "exact" if result.exact else f"{len(result.mismatches)} mismatches"
        if result.undelivered:
            verdict += f" ({result.undelivered} outputs to addresses already gone)"
        print(
            f"{done.name}: replayed {result.inputs} inputs, {result.outputs} outputs: "
            f"{verdict}; {done.summary}"
        )
        for line in result.mismatches[:20]:
            print(f"  {line}")
    return 0 if all(done.result.exact for done in replays) else 1
