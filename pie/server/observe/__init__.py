"""What the server tells operators and orchestrators: Prometheus metrics (metrics.py, read from
the engine's statistics by collector.py, the token latencies folded from the event log by
token_times.py) and the /metrics, /health and /ready routes (probes.py)."""
