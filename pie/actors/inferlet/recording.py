"""The inferlet actor's side of recording host calls ([event_log] record_inferlets): the linker a
recorded instance runs with, and each instance's recorder, whose chunks reach the log through
the instance's bridge as `HostCallsRecorded` events to the inferlet actor."""

from __future__ import annotations

import contextlib

from wasmtime.component import Component, Linker

from pie.config import EventLogConfig
from pie.events.recording import HostCallsRecorded
from pie.sandbox import GuestStopped, WasmRuntime
from pie.sandbox.host import InstanceState
from pie.sandbox.recording import (
    Chunk,
    Recorder,
    RecordingBudget,
    RecordingLimits,
    RecordingLinkers,
)

MIB = 1 << 20


def recording_limits(config: EventLogConfig) -> RecordingLimits | None:
    """What [event_log] asks for: None unless inferlets are recorded into a log."""
    if not (config.enabled and config.record_inferlets):
        return None
    return RecordingLimits(
        max_bytes=max(1, int(config.record_max_mb * MIB)),
        user_bytes=max(1, int(config.record_user_mb * MIB)),
    )


class InstanceRecordings:
    def __init__(self, wasm: WasmRuntime, limits: RecordingLimits) -> None:
        self.limits = limits
        self._linkers = RecordingLinkers(wasm)
        self._budget = RecordingBudget(limits.user_bytes)

    def linker_for(self, component: Component) -> Linker:
        return self._linkers.for_component(component)

    def recorder(self, state: InstanceState) -> Recorder:
        """A recorder for the instance `state` stands for (bind it on its guest thread)."""

        def sink(chunk: Chunk) -> None:
            event = HostCallsRecorded(
                instance=state.instance,
                first=chunk.first,
                calls=chunk.calls,
                final=chunk.final,
                stopped=chunk.stopped,
            )
            with contextlib.suppress(GuestStopped):  # the engine has stopped: nothing logs
                state.bridge.post("inferlets", event)

        return Recorder(sink, max_bytes=self.limits.max_bytes, budget=self._budget, user=state.user)
