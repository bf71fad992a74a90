"""What the engine writes into its event log beside the deliveries, so that `pie replay` can
rebuild every pure core as it ran: each model's figures, the cores' settings, and each program
binding the inferlet core resolves launches against."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from pie.actors.inferlet.admission import AdmissionLimits
from pie.actors.inferlet.programs import Owner, ProgramInfo, ProgramRegistry
from pie.config import EngineConfig
from pie.eventlog import EventLog
from pie.events.batching import CoresConfigured
from pie.events.inferlet import ProgramRegistered

PROGRAMS = "programs"
"""The address program bindings are recorded under (they are not deliveries to an actor)."""


def cores_configured(config: EngineConfig, admission: AdmissionLimits) -> CoresConfigured:
    def text(value: Any) -> str:
        return json.dumps(attrs.asdict(value), sort_keys=True)

    return CoresConfigured(
        kv=text(config.kv),
        scheduler=text(config.scheduler),
        bus=text(config.bus),
        admission=text(admission),
    )


def program_registered(info: ProgramInfo, owner: Owner) -> ProgramRegistered:
    return ProgramRegistered(
        hash=info.hash, name=info.name, version=info.version, owner=owner, size=info.size
    )


def record_start(
    log: EventLog,
    started: Sequence[Any],
    config: EngineConfig,
    admission: AdmissionLimits,
    programs: ProgramRegistry,
) -> None:
    """Appends the start records (on the Trio thread) and records every later program binding:
    at once on the Trio thread, from other threads (installs, restores) through the Trio loop,
    so that the log keeps one writer."""
    for record in started:
        log.append("engine", "engine", record)
    log.append("engine", "engine", cores_configured(config, admission))
    for info, owner in programs.bindings():
        log.append(PROGRAMS, PROGRAMS, program_registered(info, owner))
    token = trio.lowlevel.current_trio_token()
    trio_thread = threading.get_ident()

    def added(info: ProgramInfo, owner: Owner) -> None:
        record = program_registered(info, owner)
        if threading.get_ident() == trio_thread:
            log.append(PROGRAMS, PROGRAMS, record)
            return
        try:
            token.run_sync_soon(log.append, PROGRAMS, PROGRAMS, record)
        except trio.RunFinishedError:
            pass  # the engine has stopped: nothing can launch it any more

    programs.on_add = added
