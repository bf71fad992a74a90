"""The speculator's pure core: it adds up the tallies the lanes report with each pass.

The staging itself happens on the driver thread (lanes.py), where a hit costs no thread hop;
this actor is where the counts live, in the statistics and, through its inputs, in the event
log, so that a replay of the log reproduces them.
"""

from __future__ import annotations

from typing import Any

import attrs
from attrs import frozen

from pie.events.speculation import SpeculationTally


@frozen(kw_only=True)
class SpeculationStatistics:
    depth: int
    staged: int
    hits: int
    misses: int
    dropped_chains: int
    wasted_passes: int
    direct: int
    leases: int

    @property
    def hit_rate(self) -> float:
        """Hits per staged pass that was settled (used or thrown away)."""
        settled = self.hits + self.wasted_passes
        return self.hits / settled if settled else 0.0


class SpeculatorCore:
    accepts = SpeculationTally

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.totals = SpeculationTally()

    def handle(self, event: Any) -> list[tuple[str, Any]]:
        if not isinstance(event, SpeculationTally):
            raise TypeError(f"speculator got an unexpected event {type(event).__name__}")
        mine, theirs = attrs.asdict(self.totals), attrs.asdict(event)
        self.totals = SpeculationTally(**{k: mine[k] + theirs[k] for k in mine})
        return []

    def statistics(self) -> SpeculationStatistics:
        return SpeculationStatistics(depth=self.depth, **attrs.asdict(self.totals))
