"""The data plane: what carries tokens, with no Trio in it. The pass loop (loop.py) runs every
forward pass on one thread; the batch former (former.py) decides what each pass holds and when
it fires; lanes (lanes.py, lane.py) run plain decodes on the fast path, and the speculator
(speculator.py) stages their next passes ahead; a speaking model's speech requests (speech.py)
step between passes. The actors reach it only through the inference
actor; the sandbox only through the `FastPath` protocol the engine fills with the lanes."""

from pie.dataplane.former import (
    BatchFormer,
    BatchPolicy,
    BatchStatistics,
    FormedPass,
    LaneState,
)
from pie.dataplane.lanes import Lanes
from pie.dataplane.loop import PassLoop, PassObserver, PassReport, PassSummary, PassTimes
from pie.dataplane.speculator import SpeculationStatistics, Speculator
from pie.dataplane.speech import Speaker, SpeechDesk, SpeechStatistics

__all__ = [
    "BatchFormer",
    "BatchPolicy",
    "BatchStatistics",
    "FormedPass",
    "LaneState",
    "Lanes",
    "PassLoop",
    "PassObserver",
    "PassReport",
    "PassSummary",
    "PassTimes",
    "SpeculationStatistics",
    "Speculator",
    "Speaker",
    "SpeechDesk",
    "SpeechStatistics",
]
