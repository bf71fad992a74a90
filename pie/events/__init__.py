"""The vocabulary every actor speaks: frozen attrs events, ids, and one codec (codec.py)."""

from __future__ import annotations

import attrs

from pie.events import (
    batching,
    bus,
    forward,
    http,
    inferlet,
    kv,
    mcp,
    recording,
    sampling,
    speculation,
)

EVENT_MODULES = (kv, batching, bus, forward, sampling, inferlet, speculation, http, mcp, recording)


def _event_classes() -> tuple[type, ...]:
    seen: dict[str, type] = {}
    for module in EVENT_MODULES:
        for name, obj in vars(module).items():
            if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == module.__name__:
                if name in seen and seen[name] is not obj:
                    raise RuntimeError(f"two event classes named {name}")
                seen[name] = obj
    return tuple(seen.values())


ALL_EVENTS: tuple[type, ...] = _event_classes()
"""Every event class, each with a unique name: the wire and log tag."""
