"""The inferlet actor: admission, lifecycle and host bridge of every inferlet instance."""

from pie.actors.inferlet.actor import InferletActor
from pie.actors.inferlet.core import InferletCore, InferletStatistics
from pie.actors.inferlet.programs import ProgramError, ProgramInfo, ProgramRegistry

__all__ = [
    "InferletActor",
    "InferletCore",
    "InferletStatistics",
    "ProgramError",
    "ProgramInfo",
    "ProgramRegistry",
]
