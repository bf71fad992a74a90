"""Keeps the objects alive once an engine has started out of the cyclic garbage collector's
full passes, which would otherwise walk the whole start-up heap (the model's modules, the
compiled programs, the imports) every time they run."""

from __future__ import annotations

import gc


def settle_heap() -> int:
    """Collects what start-up left behind, then moves every object still alive to the
    collector's permanent generation (`gc.freeze`); returns how many. A full pass walked about
    200,000 start-up objects for 90 to 180 ms, a pause every running inferlet felt; frozen, it
    walks only what was made since. Call it once a process's engine is up: objects frozen are
    still freed when their last reference goes, but a cycle among them would never be."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_heap() -> None:
    """Undoes `settle_heap` once the engine it settled has stopped, in a process that starts
    engines in turn (a benchmark's repeats): the stopped engine's objects hold cycles, which the
    permanent generation would keep for good, and each later full pass would walk what they
    still reach."""
    gc.unfreeze()
    gc.collect()
