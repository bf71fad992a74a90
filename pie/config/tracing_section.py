"""The [tracing] section: OpenTelemetry spans of launches, their host calls and the passes that
served them (docs/event-log.md#traces)."""

from __future__ import annotations

import importlib.util
from typing import Any

import attrs
from attrs import field, frozen

from pie.config.checks import at_least

OTLP_EXPORTER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-http"


def exporter_missing() -> str | None:
    """Why the OTLP exporter cannot be imported, or None when it can."""
    try:
        if importlib.util.find_spec(OTLP_EXPORTER) is not None:
            return None
    except ImportError:
        pass
    return (
        f"tracing.otlp_endpoint is set but the OTLP exporter is not installed: "
        f"pip install {OTLP_PACKAGE}"
    )


def _endpoint(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value:
        return
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"tracing.otlp_endpoint must be an http(s) URL, got {value!r}")
    missing = exporter_missing()
    if missing is not None:
        raise ValueError(missing)


def _ratio(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"tracing.sample_ratio must be in [0, 1], got {value}")


@frozen(kw_only=True)
class TracingConfig:
    """Off by default; on, each engine keeps a tracer provider of its own."""

    enabled: bool = False
    otlp_endpoint: str = field(default="", validator=_endpoint)
    """Where spans are sent over OTLP/HTTP (e.g. http://localhost:4318/v1/traces); empty: to
    no collector (spans reach only exporters added in code)."""
    service_name: str = "pie"
    sample_ratio: float = field(default=1.0, validator=_ratio)
    """Of launches a client starts, those traced (with their children and host calls); a pass
    is traced when it served a traced launch, else at this ratio."""
    max_spans_per_inferlet: int = field(default=1000, validator=at_least(1))
    """Host-call spans one launch records; later ones are only counted (`pie.spans_dropped`)."""
    max_queued_spans: int = field(default=2048, validator=at_least(1))
    """Ended spans waiting for the OTLP exporter; past it, new ones are dropped."""
