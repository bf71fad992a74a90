"""The lanes' speculation counters: what has happened since the last `SpeculationTally` was
posted, and the totals (pie/actors/speculator/lanes.py keeps one of each)."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from pie.events.speculation import SpeculationTally

COUNTS = tuple(attrs.fields_dict(SpeculationTally))


class Counts:
    """The tally's counters as plain attributes, so a pass or a hit adds one cheaply."""

    __slots__ = COUNTS
    staged: int
    hits: int
    misses: int
    dropped_chains: int
    wasted_passes: int
    direct: int
    leases: int

    def __init__(self, *parts: Counts) -> None:
        """Zero, or the sum of `parts`."""
        for name in COUNTS:
            setattr(self, name, sum(getattr(part, name) for part in parts))

    def tally(self) -> SpeculationTally:
        return SpeculationTally(**{name: getattr(self, name) for name in COUNTS})

    def add(self, tallies: Iterable[SpeculationTally]) -> None:
        for tally in tallies:
            for name in COUNTS:
                setattr(self, name, getattr(self, name) + getattr(tally, name))

    def take(self) -> SpeculationTally | None:
        """The counts so far, reset to zero; None when there are none."""
        tally = self.tally()
        if not any(getattr(tally, name) for name in COUNTS):
            return None
        for name in COUNTS:
            setattr(self, name, 0)
        return tally
