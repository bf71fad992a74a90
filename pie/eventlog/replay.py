"""Replay: fold one actor's recorded inputs through its pure core and compare the outputs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from attrs import frozen

from pie.eventlog.log import Envelope


class Core(Protocol):
    def handle(self, event: Any) -> list[tuple[str, Any]]: ...


@frozen(kw_only=True)
class ReplayResult:
    inputs: int
    outputs: int
    mismatches: tuple[str, ...]
    """A description of each output that differs from the recorded one (empty: exact replay)."""

    @property
    def exact(self) -> bool:
        return not self.mismatches


def replay(envelopes: Iterable[Envelope], actor: str, core: Core) -> ReplayResult:
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
    mismatches = [
        f"output {i}: recorded {want!r}, replayed {got!r}"
        for i, (want, got) in enumerate(zip(recorded, produced, strict=False))
        if want != got
    ]
    if len(recorded) != len(produced):
        mismatches.append(f"recorded {len(recorded)} outputs, replayed {len(produced)}")
    return ReplayResult(inputs=len(inputs), outputs=len(produced), mismatches=tuple(mismatches))
