"""OpenTelemetry traces of the engine's work (tracing.py). Nothing is imported here, so that
importing the package does not load OpenTelemetry; the metrics are the server's
(pie/server/observe)."""
