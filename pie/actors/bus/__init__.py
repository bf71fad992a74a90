"""The messaging bus: push/pull queues and broadcast/subscribe topics between requesters."""

from pie.actors.bus.core import BusCore, BusLimits, BusStatistics

__all__ = ["BusCore", "BusLimits", "BusStatistics"]
