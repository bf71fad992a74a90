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
