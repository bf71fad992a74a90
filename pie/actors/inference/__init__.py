"""The inference actor: owns the driver and runs each batch off the Trio thread."""

from pie.actors.inference.actor import InferenceActor, InferenceStatistics

__all__ = ["InferenceActor", "InferenceStatistics"]
