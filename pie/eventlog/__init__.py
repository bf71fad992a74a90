"""Envelopes, the append-only event log, and replay of an actor's recorded inputs."""

from pie.eventlog.log import Envelope, EventLog, read_log

__all__ = ["Envelope", "EventLog", "read_log"]
