"""`pie bench` and its suites: benchmarks that print numbers (see docs/benchmarks.md)."""

from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict[str, float]:
    """The median and range of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
