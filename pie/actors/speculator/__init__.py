"""The speculator: lanes run plain decodes on the driver thread and stage the next ones ahead
(lanes.py); the actor keeps the counts (core.py)."""

from pie.actors.speculator.core import SpeculationStatistics, SpeculatorCore
from pie.actors.speculator.lanes import LaneBusy, Lanes

__all__ = ["LaneBusy", "Lanes", "SpeculationStatistics", "SpeculatorCore"]
