"""Prometheus metrics of one engine, in a registry of its own (never the global one): pass
histograms fed by the pass loops' observers, latency histograms and inferlet ends folded from
the event log, the statistics records read at scrape time, and the process's own figures."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from pie import __version__
from pie.config import MetricsConfig
from pie.dataplane import PassObserver, PassSummary
from pie.engine import Engine
from pie.server.observe.collector import EngineCollector
from pie.server.observe.token_times import Buckets, LogTail, TokenTimes

if TYPE_CHECKING:
    from pie.server.app import Server
    from pie.server.http import HttpFront

PASS_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
FOLD_SECONDS = 1.0
"""How often `run` folds the event log's new deliveries, so that a scrape finds little left."""
FIRST_TOKEN_HELP = "From an inferlet's launch request to the first sampled token sent to it."
PER_TOKEN_HELP = "Between consecutive sampled tokens sent to one context, per token."
FINISHED_HELP = (
    "Inferlets' runs ended, by the sandbox's status (returned, failed, trapped, killed, "
    "timeout, memory, quota)."
)


class EngineMetrics:
    """Watch the fronts with `watch_http` and `watch_server`; `scrape()` is the text of
    /metrics. Both, and `run`, belong on the Trio thread, where the statistics they read are
    kept."""

    def __init__(self, engine: Engine, config: MetricsConfig | None = None) -> None:
        self.config = config or MetricsConfig()
        self.registry = registry = CollectorRegistry()
        self._collector = EngineCollector(engine)
        registry.register(self._collector)
        self._tokens = TokenTimes({m.inference.address: m.name for m in engine.models})
        self._tail = LogTail(engine.log) if engine.log is not None else None
        registry.register(self)
        ProcessCollector(registry=registry)
        info = Gauge("pie_build_info", "The running pie.", ["version"], registry=registry)
        info.labels(__version__).set(1)
        self._passes = _per_model(registry, "pie_pass_duration_seconds", PASS_SECONDS)
        self._batches = _per_model(registry, "pie_pass_batch_size", BATCH_SIZES)
        for stack in engine.models:
            stack.inference.observe_passes(self._observer(stack.name))
        self._last: tuple[float, bytes] | None = None

    def watch_http(self, front: HttpFront) -> None:
        self._collector.fronts.append(front)

    def watch_server(self, server: Server) -> None:
        self._collector.servers.append(server)

    async def run(self) -> None:
        """Folds the event log's new deliveries now and then, so that a scrape after a long
        while holds the event loop no longer than one after a second."""
        while True:
            await trio.sleep(FOLD_SECONDS)
            self._fold()

    def scrape(self) -> bytes:
        """The Prometheus text; the last one's while it is under `min_scrape_ms` old."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.config.min_scrape_ms / 1000:
            return self._last[1]
        self._fold()
        text = generate_latest(self.registry)
        self._last = (now, text)
        return text

    def describe(self) -> list[Metric]:
        """Nothing to check for clashes at registration (and no scrape made to find out)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The families folded from the event log (registered as a collector)."""
        tokens = self._tokens
        yield _histogram("pie_time_to_first_token_seconds", FIRST_TOKEN_HELP, tokens.first_token)
        yield _histogram("pie_time_per_output_token_seconds", PER_TOKEN_HELP, tokens.per_token)
        finished = CounterMetricFamily("pie_inferlets_finished", FINISHED_HELP, labels=["status"])
        for status, count in sorted(tokens.finished.items()):
            finished.add_metric([status], count)
        yield finished
        missed = self._tail.missed if self._tail is not None else 0
        yield CounterMetricFamily(
            "pie_metrics_missed_events",
            "Events the event log's ring no longer held when they were to be read.",
            value=missed,
        )

    def _fold(self) -> None:
        if self._tail is not None:
            self._tokens.fold(self._tail.take(TokenTimes.KINDS))

    def _observer(self, model: str) -> PassObserver:
        passes, batches = self._passes.labels(model), self._batches.labels(model)

        def observe(summary: PassSummary) -> None:
            passes.observe(summary.seconds)
            batches.observe(summary.requests + summary.lane_passes)

        return observe


def _per_model(registry: CollectorRegistry, name: str, buckets: tuple[float, ...]) -> Histogram:
    meaning = {
        "pie_pass_duration_seconds": "Seconds of each forward pass (the driver's forward).",
        "pie_pass_batch_size": "Placed requests and lane passes in each forward pass.",
    }[name]
    return Histogram(name, meaning, ["model"], buckets=buckets, registry=registry)


def _histogram(name: str, meaning: str, by_model: dict[str, Buckets]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, meaning, labels=["model"])
    for model, buckets in sorted(by_model.items()):
        family.add_metric([model], buckets.cumulative(), buckets.sum)
    return family
