"""Every attack leaves the process as it found it: the threads it started are gone and its
memory is back near where it was (pages are checked by each test, against its own engine)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psutil
import pytest

RSS_SLACK_MB = 256
"""Memory an attack may leave behind: allocator arenas, compiled code and caches that are kept
on purpose (a leaked guest holds hundreds of MiB, a leaked 64 MiB message more than this over a
few rounds)."""

SETTLE_SECONDS = 10.0


def _threads() -> set[str]:
    """The live threads that belong to an engine or a server (named ones; the worker threads
    that trio keeps cached for reuse are left out)."""
    return {
        f"{t.name}#{t.ident}"
        for t in threading.enumerate()
        if t.is_alive()
        and not t.name.startswith("Trio thread")
        and t is not threading.main_thread()
    }


@pytest.fixture(autouse=True)
def leaves_nothing_behind() -> Iterator[None]:
    process = psutil.Process()
    threads, rss = _threads(), process.memory_info().rss
    yield
    deadline = time.monotonic() + SETTLE_SECONDS
    while (left := _threads() - threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"threads left running after the attack: {sorted(left)}"
    grown = (process.memory_info().rss - rss) / 2**20
    assert grown < RSS_SLACK_MB, f"the process grew by {grown:.0f} MiB over the attack"
