"""One engine's OpenTelemetry spans: a launch span per inferlet, a child span per host-call family
(a forward pass asked for, a generation run, a wait for a message, an HTTP fetch, an MCP call),
the engine's work for those calls under them, and a span per pass linked to the launches it
served. Spans carry the event log's correlation ids as `pie.corr`."""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import AnyValue

from pie.config import ConfigError, TracingConfig
from pie.config.tracing_section import OTLP_EXPORTER, exporter_missing
from pie.events.kv import RequestFailed

if TYPE_CHECKING:
    from pie.dataplane.loop import PassObserver, PassSummary

Attributes = Mapping[str, AnyValue]
EXPORT_BATCH = 512
SHUTDOWN_SECONDS = 5.0


class _LinkedOrRatio(Sampler):
    """Samples a root span linked to a sampled span (a pass that served a traced launch), and
    other roots at `ratio`."""

    def __init__(self, ratio: float) -> None:
        self._ratio = TraceIdRatioBased(ratio)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes | None = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if links and any(link.context.trace_flags.sampled for link in links):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self._ratio.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"LinkedOrRatio{{{self._ratio.rate}}}"


def _failed(span: Span, kind: str, message: str) -> None:
    span.set_attribute("pie.error", kind)
    span.set_status(Status(StatusCode.ERROR, f"{kind}: {message}"))


class Tracing:
    """An engine's tracer provider (never the global one) and the spans open on it.

    Launches begin and end on the Trio thread; host-call spans open and close on the guest's
    thread; pass spans are made on the pass loop's outbox thread. `shutdown` ends it."""

    def __init__(self, config: TracingConfig) -> None:
        self.config = config
        self.provider = TracerProvider(
            sampler=ParentBased(_LinkedOrRatio(config.sample_ratio)),
            resource=Resource.create({"service.name": config.service_name}),
            shutdown_on_exit=False,
        )
        self.tracer = self.provider.get_tracer("pie")
        if config.otlp_endpoint:
            self.provider.add_span_processor(
                BatchSpanProcessor(
                    _otlp_exporter(config.otlp_endpoint),
                    max_queue_size=config.max_queued_spans,
                    max_export_batch_size=min(EXPORT_BATCH, config.max_queued_spans),
                )
            )
        self._launches: dict[str, LaunchTrace] = {}
        """By instance id."""
        self._by_address: dict[str, LaunchTrace] = {}
        self.by_corr: dict[int, Span] = {}
        """Open host-call spans by the correlation id of their request (LaunchTrace keeps it)."""

    def export_to(self, exporter: SpanExporter) -> None:
        """Hands every span to `exporter` as it ends, on the thread that ends it (tests, and
        exporters that only keep spans in memory)."""
        self.provider.add_span_processor(SimpleSpanProcessor(exporter))

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> None:
        """Ends what is still open, then flushes the exporters and stops them, waiting for that
        at most `timeout` seconds (a collector that does not answer must not hold the engine)."""
        for instance in list(self._launches):
            self.ended(instance, "terminated", "the engine stopped")
        stopping = threading.Thread(
            target=self.provider.shutdown, name="pie-tracing-shutdown", daemon=True
        )
        stopping.start()
        stopping.join(timeout)

    # -- launches (Trio thread) -----------------------------------------------------------

    def launched(
        self, instance: str, *, address: str, launcher: str, corr: int, program: str, user: str
    ) -> None:
        """Starts the launch span of `instance`: under its parent's when an inferlet launched
        it (none when that one is not traced), else a trace of its own, sampled at the ratio."""
        parent = self._by_address.get(launcher)
        if parent is None and launcher.startswith("inferlet:"):
            return
        span = self.tracer.start_span(
            "pie.launch",
            context=Context() if parent is None else parent.context,
            attributes={
                "pie.corr": corr,
                "pie.instance": instance,
                "pie.program": program,
                "pie.user": user,
            },
        )
        if not span.is_recording():
            return
        launch = LaunchTrace(self, span, address, self.config.max_spans_per_inferlet)
        self._launches[instance] = launch
        self._by_address[address] = launch

    def ended(self, instance: str, status: str, error: str | None) -> None:
        launch = self._launches.pop(instance, None)
        if launch is None:
            return
        del self._by_address[launch.address]
        launch.end(status, error)

    def launch(self, instance: str) -> LaunchTrace | None:
        """The running launch's trace; None when it is not traced."""
        return self._launches.get(instance)

    # -- the engine's work for a host call (Trio thread) -----------------------------------

    @contextlib.contextmanager
    def serving(self, corr: int, name: str, attributes: Attributes) -> Iterator[Span | None]:
        """A span, for the block, of work done for the host call whose request carried `corr`,
        under that call's span; None, and nothing recorded, when the call is not traced. An
        exception marks it failed, with the exception's `kind` where it has one."""
        parent = self.by_corr.get(corr)
        if parent is None:
            yield None
            return
        span = self.tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            attributes={"pie.corr": corr, **attributes},
            record_exception=False,
            set_status_on_exception=False,
        )
        try:
            yield span
        except BaseException as exc:
            kind = getattr(exc, "kind", type(exc).__name__)
            _failed(span, str(kind), str(getattr(exc, "message", exc)))
            raise
        finally:
            span.end()

    # -- passes (a pass observer, on the thread that settles each pass) ---------------------

    def record_pass(self, model: str) -> PassObserver:
        """What records each of `model`'s passes as a span linked to the launch spans of the
        traced inferlets whose requests it ran."""

        def record(summary: PassSummary) -> None:
            launches = (self._by_address.get(r) for r in summary.requesters)
            links = [launch.link for launch in launches if launch]
            ended = int(summary.ended * 1e9)
            span = self.tracer.start_span(
                "pie.pass",
                context=Context(),
                links=links,
                attributes={
                    "pie.model": model,
                    "pie.pass": summary.number,
                    "pie.batch_size": summary.requests + summary.lane_passes,
                    "pie.lane_passes": summary.lane_passes,
                    "pie.tokens": summary.tokens,
                    "pie.failed": summary.failed,
                    "pie.corrs": summary.corrs,
                },
                start_time=ended - int(summary.seconds * 1e9),
            )
            span.end(end_time=ended)

        return record


class LaunchTrace:
    """One traced launch: its span and the host-call spans open under it. The guest's thread
    opens and closes those; the launch's end closes what is left."""

    def __init__(self, tracing: Tracing, span: Span, address: str, room: int) -> None:
        self.span = span
        self.address = address
        self.context = trace.set_span_in_context(span)
        self.link = Link(span.get_span_context())
        """What links a pass to this launch (made once: every pass it takes part in has one)."""
        self._tracer = tracing.tracer
        self._by_corr = tracing.by_corr
        self._room = room
        self._open: dict[int, tuple[Span, int | None]] = {}
        self._ended = False
        self._lock = threading.Lock()
        self.dropped = 0
        """Host-call spans not recorded for lack of room."""

    def opened(
        self, handle: int, name: str, corr: int | None = None, attributes: Attributes | None = None
    ) -> None:
        """Starts the span of the host call that `handle` (a pollable or a run) stands for,
        unless the launch has recorded as many as it may."""
        with self._lock:
            if self._room <= 0:
                self.dropped += 1
                return
            self._room -= 1
        given = dict(attributes or {})
        if corr is not None:
            given["pie.corr"] = corr
        span = self._tracer.start_span(name, context=self.context, attributes=given)
        with self._lock:
            ended = self._ended
            if not ended:
                self._open[handle] = (span, corr)
                if corr is not None:
                    self._by_corr[corr] = span
        if ended:
            span.end()

    def closed(
        self,
        handle: int,
        failure: RequestFailed | None = None,
        attributes: Attributes | None = None,
    ) -> None:
        """Ends the span of `handle`, if it has one; `failure` (a RequestFailed) marks it
        failed."""
        with self._lock:
            entry = self._open.pop(handle, None)
        if entry is not None:
            self._end(*entry, failure, attributes)

    def end(self, status: str, error: str | None) -> None:
        """Ends the launch span, and any host-call span its program left open."""
        with self._lock:
            left, self._open = list(self._open.values()), {}
            self._ended = True
        for span, corr in left:
            self._end(span, corr, None, {"pie.abandoned": True})
        self.span.set_attributes({"pie.outcome": status, "pie.spans_dropped": self.dropped})
        if error is not None:
            _failed(self.span, status, error)
        self.span.end()

    def _end(
        self,
        span: Span,
        corr: int | None,
        failure: RequestFailed | None,
        attributes: Attributes | None,
    ) -> None:
        if corr is not None:
            self._by_corr.pop(corr, None)
        if attributes:
            span.set_attributes(attributes)
        if failure is not None:
            _failed(span, failure.kind, failure.message)
        span.end()


def _otlp_exporter(endpoint: str) -> SpanExporter:
    missing = exporter_missing()
    if missing is not None:
        raise ConfigError(missing)
    module: Any = importlib.import_module(OTLP_EXPORTER)
    exporter: SpanExporter = module.OTLPSpanExporter(endpoint=endpoint)
    return exporter
