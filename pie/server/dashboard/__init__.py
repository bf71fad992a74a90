"""The live dashboard the HTTP front serves at /dashboard: actors and mailbox depths, the pass
timeline, the KV page map, running inferlets and a live, filtered tail of the event log."""

from pie.server.dashboard.service import Dashboard

__all__ = ["Dashboard"]
