"""What the dashboard shows of a running engine, as JSON-ready data: its statistics (mailbox
depths among them), each model's KV page map and recent passes, and every inferlet."""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

import attrs

from pie.actors.kv.state import KvState
from pie.dataplane import PassSummary
from pie.server.dashboard.tail import TailHub

if TYPE_CHECKING:
    from pie.engine import Engine

PAGE_MARKS = {"free": "f", "cached": "c", "used": "u", "shared": "s", "saved": "v"}
"""One character per page in a page map: held by a named snapshot (saved), by more than one
context (shared), by one (used), free but still holding reusable content (cached), or free."""


class Timeline:
    """The last passes of one model, told by its pass loop on the data plane's threads."""

    def __init__(self, size: int) -> None:
        self._passes: collections.deque[PassSummary] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def observe(self, summary: PassSummary) -> None:
        with self._lock:
            self._passes.append(summary)

    def passes(self) -> list[PassSummary]:
        with self._lock:
            return list(self._passes)


def page_map(kv: KvState) -> str:
    """Each page's mark (PAGE_MARKS), page 0 first."""
    pool = kv.pool
    saved = {page for chain in kv.snapshots.values() for page in chain.pages if page >= 0}
    cached = set(pool.cache_order())
    marks = []
    for page in range(pool.num_pages):
        owners = pool.owners(page)
        if page in saved:
            marks.append("v")
        elif owners > 1:
            marks.append("s")
        elif owners == 1:
            marks.append("u")
        else:
            marks.append("c" if page in cached else "f")
    return "".join(marks)


def page_counts(marks: str) -> dict[str, int]:
    return {kind: marks.count(mark) for kind, mark in PAGE_MARKS.items()}


def engine_state(engine: Engine, timelines: list[Timeline], hub: TailHub) -> dict[str, Any]:
    """Everything the page shows, read on the Trio thread (where the actors' state changes)."""
    return {
        "time": time.time(),
        "statistics": attrs.asdict(engine.statistics()),
        "models": [
            _model(stack.name, stack.kv.core, timeline)
            for stack, timeline in zip(engine.models, timelines, strict=True)
        ],
        "inferlets": _inferlets(engine),
        "tails": attrs.asdict(hub.statistics()),
    }


def _model(name: str, kv: KvState, timeline: Timeline) -> dict[str, Any]:
    marks = page_map(kv)
    return {
        "name": name,
        "page_size": kv.page_size,
        "pages": marks,
        "page_counts": page_counts(marks),
        "passes": [attrs.asdict(summary) for summary in timeline.passes()],
    }


def _inferlets(engine: Engine) -> list[dict[str, Any]]:
    """Every instance, with the contexts its address owns and the tokens in them."""
    contexts: collections.Counter[str] = collections.Counter()
    tokens: collections.Counter[str] = collections.Counter()
    for stack in engine.models:
        for chain in stack.kv.core.contexts.values():
            contexts[chain.owner] += 1
            tokens[chain.owner] += len(chain.tokens)
    rows = []
    for instance in engine.inferlets.core.listing():
        address = f"inferlet:{instance.id}"
        program = instance.program
        rows.append(
            {
                "id": instance.id,
                "address": address,
                "user": instance.user,
                "program": f"{program.name}@{program.version}",
                "hash": program.hash,
                "state": instance.state,
                "launcher": instance.launcher,
                "depth": instance.depth,
                "contexts": contexts[address],
                "tokens": tokens[address],
            }
        )
    return rows
