"""The scheduler actor: forms batches across contexts under the driver's limits."""

from pie.actors.scheduler.core import BatchPolicy, SchedulerCore, SchedulerStatistics

__all__ = ["BatchPolicy", "SchedulerCore", "SchedulerStatistics"]
