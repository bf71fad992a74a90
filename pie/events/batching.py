"""Events between the kv actor, the inference actor and the requester."""

from __future__ import annotations

from attrs import frozen

from pie.events.forward import ForwardRequest
from pie.events.sampling import SlotOutput


@frozen(kw_only=True)
class ScheduleForward:
    """A placed request, for the data plane's batch former to put in a pass."""

    request: ForwardRequest


@frozen(kw_only=True)
class ForwardCompleted:
    """The answer to a SubmitForward: one output per sampling slot, in slot order."""

    corr: int
    context: int
    outputs: tuple[SlotOutput, ...]


@frozen(kw_only=True)
class EngineStarted:
    """First record of every event log: what a replay needs to rebuild the cores."""

    model: str
    vocab_size: int
    page_size: int
    num_pages: int
    max_batch_tokens: int
    max_batch_requests: int
    prefix_cache: str = "user"
    sliding_window: int | None = None
    adapters: tuple[str, ...] = ()
    """The LoRA adapters the driver loaded: a pass may name one."""
    index: int = 0
    count: int = 1
    """The model's place among the engine's models (its actors' addresses and context ids)."""
    directory: str | None = None
    """Where the kv core hands commands on snapshots it lacks (a clustered node's directory)."""


@frozen(kw_only=True)
class CoresConfigured:
    """Second record of every event log: the settings the engine's pure cores were built with,
    each a JSON object (the [kv], [scheduler] and [bus] tables, and the inferlet admission
    limits), so that `pie replay` rebuilds them as they ran."""

    kv: str
    scheduler: str
    bus: str
    admission: str


@frozen(kw_only=True)
class FormerSubmit:
    """The batch former took placed request `corr` (its ScheduleForward) at clock `now`."""

    corr: int
    now: float


@frozen(kw_only=True)
class FormerDrop:
    corr: int


@frozen(kw_only=True)
class FormerFinished:
    """The pass in flight took `seconds` and ended at clock `now`."""

    seconds: float
    now: float


@frozen(kw_only=True)
class FormerDeadline:
    """The former was asked when its watchdog fires, with these lanes; it said `at`."""

    ready: int
    awaited: bool
    at: float | None


@frozen(kw_only=True)
class FormerNext:
    """The former was asked for a pass at clock `now`, with these lanes: it formed `batch`
    (0: none) of placed requests (corr, tokens, final) and `lanes` lane passes."""

    now: float
    ready: int
    awaited: bool
    batch: int = 0
    requests: tuple[tuple[int, int, bool], ...] = ()
    lanes: int = 0


FormerStep = FormerSubmit | FormerDrop | FormerFinished | FormerDeadline | FormerNext


@frozen(kw_only=True)
class FormerSteps:
    """What a model's batch former was asked and answered since the last record, in order:
    its clock readings and lane counts are inputs here, so replay decides exactly as it did."""

    model: str
    steps: tuple[FormerStep, ...]
