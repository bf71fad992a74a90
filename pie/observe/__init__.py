"""What the engine tells its operators about itself: metrics and probes (metrics.py,
probes.py) and OpenTelemetry traces (tracing.py).

Nothing is imported here, so that importing one part does not load another's libraries."""
