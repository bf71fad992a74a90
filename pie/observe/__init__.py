"""What the engine tells its operators about its work: OpenTelemetry traces (tracing.py).

Nothing is imported here, so that importing one part does not load another's libraries."""
