"""Replay of every pure core over a recorded run: each kv core, the bus, the inferlet lifecycle
and each model's batch former are rebuilt from the log's start records and fed what they
received (the former: what it was asked, with the clock readings it saw), and what they say
is checked against what was recorded."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from attrs import frozen

from pie.actors.bus import BusCore, BusLimits
from pie.actors.inferlet.admission import AdmissionLimits
from pie.actors.inferlet.core import InferletCore
from pie.actors.inferlet.programs import ProgramRegistry
from pie.config import EngineConfig, with_overrides
from pie.dataplane.former import BatchFormer, BatchPolicy, LaneState
from pie.dataplane.tape import next_step
from pie.engine.records import PROGRAMS
from pie.engine.stack import addresses, former_address, kv_core
from pie.eventlog import Envelope
from pie.eventlog.replay import ReplayResult, Transient, compare, replay
from pie.events.batching import (
    CoresConfigured,
    EngineStarted,
    FormerDeadline,
    FormerDrop,
    FormerFinished,
    FormerNext,
    FormerSteps,
    FormerSubmit,
    ScheduleForward,
)
from pie.events.inferlet import ProgramRegistered

INFERLETS = "inferlets"
CORES = ("kv", "bus", "inferlets", "former")
"""The kinds of core `replay_cores` can be limited to."""


class NotReplayable(ValueError):
    """The log lacks what a replay needs (its start records)."""


@frozen(kw_only=True)
class CoreReplay:
    name: str
    """The core's address in the log (`kv`, `kv:MODEL`, `bus`, `inferlets`, `inference.former`)."""
    result: ReplayResult
    summary: str
    """The replayed core's final state, in a few words."""


def replay_cores(envelopes: Iterable[Envelope], only: str | None = None) -> list[CoreReplay]:
    """Replays every core (or those of kind `only`, one of CORES) over `envelopes`."""
    envelopes = list(envelopes)
    models = [e.event for e in envelopes if isinstance(e.event, EngineStarted)]
    if not models:
        raise NotReplayable("the log has no EngineStarted record")
    config = _config(envelopes)
    cores = {INFERLETS, "bus", "http", "mcp"}
    for m in models:
        kv, inference = addresses(m.index, m.model)
        cores |= {kv, inference, former_address(inference)}

    def transient(address: str) -> bool:
        return address not in cores

    kinds: dict[str, Callable[[], list[CoreReplay]]] = {
        "kv": lambda: [_kv(envelopes, config, m, transient) for m in models],
        "bus": lambda: [_bus(envelopes, config, transient)],
        "inferlets": lambda: [_inferlets(envelopes, transient)],
        "former": lambda: [_former(envelopes, config, m) for m in models],
    }
    chosen = (only,) if only else CORES
    return [done for kind in chosen for done in kinds[kind]()]


def _config(envelopes: Sequence[Envelope]) -> EngineConfig:
    cores = _cores_record(envelopes)
    if cores is None:
        return EngineConfig()  # a log from before the record: the defaults
    return with_overrides(
        EngineConfig(),
        kv=json.loads(cores.kv),
        scheduler=json.loads(cores.scheduler),
        bus=json.loads(cores.bus),
    )


def _cores_record(envelopes: Sequence[Envelope]) -> CoresConfigured | None:
    return next((e.event for e in envelopes if isinstance(e.event, CoresConfigured)), None)


def _kv(
    envelopes: Sequence[Envelope], config: EngineConfig, model: EngineStarted, transient: Transient
) -> CoreReplay:
    info = SimpleNamespace(
        model_name=model.model,
        num_pages=model.num_pages,
        page_size=model.page_size,
        vocab_size=model.vocab_size,
        sliding_window=model.sliding_window,
        adapters=model.adapters,
    )
    config = with_overrides(config, kv={"prefix_cache": model.prefix_cache})
    core = kv_core(config, info, index=model.index, count=model.count, directory=model.directory)
    address = addresses(model.index, model.model)[0]
    result = replay(envelopes, address, core, transient)
    stats = core.statistics()
    summary = (
        f"pages free {stats.pages_free}/{stats.pages_total}, contexts {stats.contexts}, "
        f"snapshots {stats.snapshots}"
    )
    return CoreReplay(name=address, result=result, summary=summary)


def _bus(envelopes: Sequence[Envelope], config: EngineConfig, transient: Transient) -> CoreReplay:
    core = BusCore(BusLimits.from_config(config.bus))
    result = replay(envelopes, "bus", core, transient)
    stats = core.statistics()
    summary = (
        f"queues {stats.queues} ({stats.queued_messages} messages), topics {stats.topics}, "
        f"delivered {stats.delivered}"
    )
    return CoreReplay(name="bus", result=result, summary=summary)


def _inferlets(envelopes: Sequence[Envelope], transient: Transient) -> CoreReplay:
    """The lifecycle core, with the program bindings replayed where they were recorded. Its
    shell's sends to itself (an instance's end) are inputs, not outputs."""
    cores = _cores_record(envelopes)
    limits = AdmissionLimits(**json.loads(cores.admission)) if cores else AdmissionLimits()
    registry = ProgramRegistry()
    core = InferletCore(registry, limits)
    inputs = 0
    produced: list[tuple[str, Any]] = []
    for env in envelopes:
        if env.dst == PROGRAMS and isinstance(env.event, ProgramRegistered):
            bound = env.event
            placeholder = b"\0asm" + bytes(max(bound.size - 4, 0))
            registry.add(
                placeholder, bound.name, bound.version, owner=bound.owner, digest=bound.hash
            )
        elif env.dst == INFERLETS:
            inputs += 1
            produced.extend(out for out in core.handle(env.event) if out[0] != INFERLETS)
            core.to_start.clear()
            core.to_kill.clear()
    recorded = [(e.dst, e.event) for e in envelopes if e.src == INFERLETS and e.dst != INFERLETS]
    result = compare(inputs, recorded, produced, transient)
    stats = core.statistics()
    summary = (
        f"launched {stats.launched}, returned {stats.returned}, failed {stats.failed}, "
        f"terminated {stats.terminated}, running {stats.running}, queued {stats.queued}"
    )
    return CoreReplay(name=INFERLETS, result=result, summary=summary)


def _former(
    envelopes: Sequence[Envelope], config: EngineConfig, model: EngineStarted
) -> CoreReplay:
    """The batch former, asked what it was asked, with the clocks and lane counts it saw;
    each answer (a formed pass or none, a watchdog deadline) is checked."""
    inference = addresses(model.index, model.model)[1]
    address = former_address(inference)
    placed = {
        e.event.request.corr: e.event.request
        for e in envelopes
        if e.dst == inference and isinstance(e.event, ScheduleForward)
    }
    policy = BatchPolicy(
        max_batch_tokens=model.max_batch_tokens,
        max_batch_requests=model.max_batch_requests,
        decode_tokens=config.scheduler.decode_tokens,
    )
    former = BatchFormer(policy)
    steps = [
        step
        for e in envelopes
        if e.dst == address and isinstance(e.event, FormerSteps)
        for step in e.event.steps
    ]
    decisions, mismatches = 0, []
    for number, step in enumerate(steps):
        problem = _step(former, placed, step)
        if isinstance(step, FormerNext | FormerDeadline):
            decisions += 1
        if problem:
            mismatches.append(f"step {number}: {problem}")
    stats = former.statistics()
    summary = f"passes {stats.batches}, mean batch {stats.mean_batch_size:.2f}"
    result = ReplayResult(inputs=len(steps), outputs=decisions, mismatches=tuple(mismatches))
    return CoreReplay(name=address, result=result, summary=summary)


def _step(former: BatchFormer, placed: dict[int, Any], step: Any) -> str | None:
    """Applies one recorded step; what differs from the recorded answer, or None."""
    match step:
        case FormerSubmit():
            if step.corr not in placed:
                return f"no ScheduleForward of request {step.corr} in the log"
            former.submit(placed[step.corr], step.now)
        case FormerDrop():
            former.drop(step.corr)
        case FormerFinished():
            former.pass_finished(step.seconds, step.now)
        case FormerDeadline():
            at = former.deadline(LaneState(ready=step.ready, awaited=step.awaited))
            if at != step.at:
                return f"deadline: recorded {step.at!r}, replayed {at!r}"
        case FormerNext():
            lanes = LaneState(ready=step.ready, awaited=step.awaited)
            formed = former.next_batch(step.now, lanes)
            replayed = next_step(step.now, step.ready, step.awaited, formed)
            if replayed != step:
                return f"next pass: recorded {step!r}, replayed {replayed!r}"
    return None
