"""Replay: fold one actor's recorded inputs through its pure core and compare the outputs."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from attrs import frozen

from pie.eventlog.log import Envelope


class Core(Protocol):
    def handle(self, event: Any) -> list[tuple[str, Any]]: ...


Transient = Callable[[str], bool]
"""Whether an address can go away while the engine runs (a program's, a client's): the log
keeps only deliveries, so outputs to such an address after it was gone are not in it."""


@frozen(kw_only=True)
class ReplayResult:
    inputs: int
    outputs: int
    mismatches: tuple[str, ...]
    """A description of each output that differs from the recorded one (empty: exact replay)."""
    undelivered: int = 0
    """Replayed outputs to transient addresses past the last delivery recorded to each."""

    @property
    def exact(self) -> bool:
        return not self.mismatches


def replay(
    envelopes: Iterable[Envelope], actor: str, core: Core, transient: Transient | None = None
) -> ReplayResult:
    """Feeds every event recorded as delivered to `actor` into `core`, in log order.

    Trio runs tasks in a random order, so replay never re-runs interleavings: it re-feeds what
    the actor actually received and checks that the core says what the actor actually said.
    """
    envelopes = list(envelopes)
    inputs = [e.event for e in envelopes if e.dst == actor]
    recorded = [(e.dst, e.event) for e in envelopes if e.src == actor]
    produced: list[tuple[str, Any]] = []
    for event in inputs:
        produced.extend(core.handle(event))
    return compare(len(inputs), recorded, produced, transient)


def compare(
    inputs: int,
    recorded: list[tuple[str, Any]],
    produced: list[tuple[str, Any]],
    transient: Transient | None = None,
) -> ReplayResult:
    """The replay of `inputs` inputs whose outputs were `recorded` and are now `produced`, in
    the same order. Produced outputs to a `transient` address beyond the number recorded to it
    are counted as undelivered (it had gone) instead of as mismatches."""
    expected = collections.Counter(dst for dst, _ in recorded)
    counted: collections.Counter[str] = collections.Counter()
    kept = []
    for dst, event in produced:
        counted[dst] += 1
        if transient is None or counted[dst] <= expected[dst] or not transient(dst):
            kept.append((dst, event))
    mismatches = [
        f"output {i}: recorded {want!r}, replayed {got!r}"
        for i, (want, got) in enumerate(zip(recorded, kept, strict=False))
        if want != got
    ]
    if len(recorded) != len(kept):
        mismatches.append(f"recorded {len(recorded)} outputs, replayed {len(kept)}")
    return ReplayResult(
        inputs=inputs,
        outputs=len(produced),
        mismatches=tuple(mismatches),
        undelivered=len(produced) - len(kept),
    )
