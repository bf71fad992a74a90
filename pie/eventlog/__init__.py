"""Envelopes, the append-only event log, and replay of an actor's recorded inputs."""

from pie.eventlog.log import (
    Envelope,
    EventLog,
    EventLogStatistics,
    LogGap,
    read_entries,
    read_log,
)
from pie.eventlog.records import Gap
from pie.eventlog.writer import WriterStatistics

__all__ = [
    "Envelope",
    "EventLog",
    "EventLogStatistics",
    "Gap",
    "LogGap",
    "WriterStatistics",
    "read_entries",
    "read_log",
]
