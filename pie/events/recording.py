"""An inferlet's host calls, recorded for replay ([event_log] record_inferlets): each instance
sends its calls to the inferlet actor in chunks, so they land in the log in order."""

from __future__ import annotations

from attrs import frozen


@frozen(kw_only=True)
class HostCallsRecorded:
    """Calls `first` onwards (numbered from 0) of one instance: a JSON array of
    `[function, arguments, result]`, values in the form of pie/sandbox/callvalues.py."""

    instance: str
    first: int
    calls: str
    final: bool = False
    """The instance has ended: no calls follow."""
    stopped: str = ""
    """Why the recording stopped after these calls (record_max_mb, record_user_mb), if it did."""
