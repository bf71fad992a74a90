"""Time to first token, time per output token and how inferlets ended, folded from the event
log's deliveries (read off the per-token path: when scraped, and once a second meanwhile)."""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Mapping
from typing import Any

from pie.eventlog import EventLog
from pie.eventlog.records import Row
from pie.events.batching import ForwardCompleted
from pie.events.inferlet import InferletFinished, InferletLaunched, LaunchInferlet
from pie.events.sampling import TokenOutput
from pie.events.speculation import LanePassesApplied

MAX_TRACKED = 65_536
"""Launches awaiting their first token, and contexts awaiting their next, kept at most: the
oldest are forgotten first (a client's contexts never end with an inferlet)."""
FIRST_TOKEN = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Buckets:
    """A histogram's counts: how many observations fell at or below each bound (and above the
    last), and their sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """(upper bound, observations at or below it) for each bucket, "+Inf" last."""
        running, out = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class TokenTimes:
    """Follows launches to their first sampled token and each context from one sampled token
    to the next. `models` maps each inference actor's address to its model's name."""

    def __init__(self, models: Mapping[str, str]) -> None:
        self.models = dict(models)
        self.first_token: dict[str, Buckets] = {}
        self.per_token: dict[str, Buckets] = {}
        self.finished = collections.Counter[str]()
        """Inferlets' ends by the sandbox's status."""
        self._launches: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._waiting: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Instance address -> when it was launched, until its first sampled token."""
        self._last: collections.OrderedDict[int, float] = collections.OrderedDict()
        """Context -> when its last sampled token reached its program."""
        self._contexts: dict[str, set[int]] = {}
        """Instance address -> the contexts it was sent tokens on (forgotten when it ends)."""

    KINDS = (
        LaunchInferlet,
        InferletLaunched,
        ForwardCompleted,
        LanePassesApplied,
        InferletFinished,
    )
    """The events `fold` reads."""

    def fold(self, rows: Iterable[Row]) -> None:
        """Takes in the log's rows (in order, each once)."""
        for _, when, src, dst, _, event in rows:
            match event:
                case LaunchInferlet():
                    _remember(self._launches, event.corr, when)
                case InferletLaunched():
                    launched = self._launches.pop(event.corr, None)
                    if launched is not None:
                        _remember(self._waiting, f"inferlet:{event.instance}", launched)
                case ForwardCompleted():
                    tokens = sum(isinstance(out, TokenOutput) for out in event.outputs)
                    if tokens:
                        self._placed(src, dst, event.context, tokens, when)
                case LanePassesApplied():
                    model = self.models.get(src, src)
                    for applied in event.passes:
                        self._token(model, applied.context, 1, when)
                case InferletFinished():
                    self._ended(f"inferlet:{event.instance}", event.status)

    def _placed(self, src: str, dst: str, context: int, tokens: int, when: float) -> None:
        model = self.models.get(src, src)
        launched = self._waiting.pop(dst, None)
        if launched is not None:
            _buckets(self.first_token, model, FIRST_TOKEN).observe(when - launched)
        if dst.startswith("inferlet:"):
            self._contexts.setdefault(dst, set()).add(context)
        self._token(model, context, tokens, when)

    def _token(self, model: str, context: int, tokens: int, when: float) -> None:
        last = self._last.get(context)
        if last is not None:
            _buckets(self.per_token, model, PER_TOKEN).observe((when - last) / tokens, tokens)
        _remember(self._last, context, when)

    def _ended(self, address: str, status: str) -> None:
        self.finished[status] += 1
        self._waiting.pop(address, None)
        for context in self._contexts.pop(address, ()):
            self._last.pop(context, None)


def _buckets(table: dict[str, Buckets], model: str, bounds: tuple[float, ...]) -> Buckets:
    found = table.get(model)
    if found is None:
        found = table[model] = Buckets(bounds)
    return found


def _remember(table: collections.OrderedDict[Any, float], key: Any, when: float) -> None:
    table[key] = when
    table.move_to_end(key)
    if len(table) > MAX_TRACKED:
        table.popitem(last=False)


class LogTail:
    """Reads an event log's ring from where the last read ended (on the Trio thread, which
    appends to it)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self._read = 0
        self.missed = 0
        """Rows gone from the ring before they were read (its `ring_size` was too small for
        the time between two reads)."""

    def take(self, kinds: tuple[type, ...] | None = None) -> list[Row]:
        """The rows appended since the last call that the ring still holds, oldest first; with
        `kinds`, only those whose event is one of them."""
        self.missed += max(0, self.log.oldest_held - self._read - 1)
        rows = self.log.rows_after(self._read, kinds)
        self._read = self.log.next_seq - 1
        return rows
