"""The causal tree of one delivery: the deliveries it caused, what those caused, and so on,
read from each envelope's `cause`."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator

from pie.eventlog.records import Envelope


def causal_tree(envelopes: Iterable[Envelope], root: int) -> Iterator[tuple[int, Envelope]]:
    """(depth, envelope) for the delivery `root` (depth 0) and everything it caused, depth
    first, each delivery's effects in log order. Raises KeyError when `root` is not there."""
    by_seq: dict[int, Envelope] = {}
    effects: dict[int, list[Envelope]] = collections.defaultdict(list)
    for env in envelopes:
        by_seq[env.seq] = env
        if env.cause is not None:
            effects[env.cause].append(env)
    if root not in by_seq:
        raise KeyError(f"no delivery with seq {root} in the log")
    # An explicit stack: a program's chain of passes is thousands of deliveries deep.
    stack = [(0, by_seq[root])]
    while stack:
        depth, env = stack.pop()
        yield depth, env
        stack.extend((depth + 1, child) for child in reversed(effects.get(env.seq, ())))


def root_of(envelopes: Iterable[Envelope], seq: int) -> int:
    """The first delivery in the chain of causes that led to `seq` (itself when uncaused)."""
    causes = {env.seq: env.cause for env in envelopes}
    if seq not in causes:
        raise KeyError(f"no delivery with seq {seq} in the log")
    seen = {seq}
    while (cause := causes.get(seq)) is not None and cause in causes and cause not in seen:
        seq = cause
        seen.add(seq)
    return seq
