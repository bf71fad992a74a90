"""What the in-memory ring keeps of an event: every text or bytes field longer than a small
prefix is cut to that prefix, so a large payload lives in the file (when there is one), not in
memory for as long as the ring holds its envelope."""

from __future__ import annotations

from typing import Any

import attrs

_PAYLOAD_TYPES = frozenset({"str", "bytes", "Any", "object"})


_FIELDS: dict[type, tuple[str, ...]] = {}


def _payload_fields(cls: type) -> tuple[str, ...]:
    """The fields of an event class that may hold a text or bytes payload."""
    known = _FIELDS.get(cls)
    if known is None:
        known = _FIELDS[cls] = _find_payload_fields(cls)
    return known


def _find_payload_fields(cls: type) -> tuple[str, ...]:
    if not attrs.has(cls):
        return ()
    names = []
    for field in attrs.fields(cls):
        spelled = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        if any(part.strip() in _PAYLOAD_TYPES for part in str(spelled).split("|")):
            names.append(field.name)
    return tuple(names)


def clip(event: Any, prefix: int) -> Any:
    """`event` with each long text or bytes field cut to `prefix` characters (or bytes) and a
    note of how long it was; the event itself when nothing is that long."""
    long = {}
    for name in _payload_fields(type(event)):
        value = getattr(event, name)
        if isinstance(value, str | bytes) and len(value) > prefix:
            long[name] = _cut(value, prefix)
    return attrs.evolve(event, **long) if long else event


def _cut(value: str | bytes, prefix: int) -> str | bytes:
    note = f"... [{len(value)} in all; the ring keeps {prefix}]"
    if isinstance(value, bytes):
        return value[:prefix] + note.encode()
    return value[:prefix] + note
