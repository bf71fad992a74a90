"""The messaging bus: push/pull queues and broadcast/subscribe topics between requesters."""

from pie.actors.bus.core import (
    MESSAGE_OVERHEAD,
    BusCore,
    BusLimits,
    BusStatistics,
    park_refusal,
    too_large,
)

__all__ = [
    "MESSAGE_OVERHEAD",
    "BusCore",
    "BusLimits",
    "BusStatistics",
    "park_refusal",
    "too_large",
]
