"""A requester: an address that sends commands to the actors and awaits their replies by
correlation id. The engine's own API, the CLI and (later) each inferlet speak through one."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import trio

from pie.actors.runtime import CAUSE, Router
from pie.events import bus as bus_ev
from pie.events import inferlet as inf_ev
from pie.events import kv as kv_ev
from pie.events.batching import ForwardCompleted
from pie.events.inferlet import InferletOutcome, outcome_of
from pie.events.sampling import Rle, SamplingSlot, SlotOutput


class RequestRefused(Exception):
    """An actor refused a command; `kind` is a stable word (out_of_pages, busy, invalid, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class InferletRun:
    """A launched inferlet as its launcher sees it: its lifecycle events, in order."""

    def __init__(self, requester: Requester, instance: str, queued: bool) -> None:
        self.requester = requester
        self.instance = instance
        self.queued = queued
        self.events: trio.MemoryReceiveChannel[Any] = requester._runs[instance][1]

    async def stream(self) -> AsyncIterator[Any]:
        """Every lifecycle event in order, the final one (an `InferletEnd`) included."""
        async for event in self.events:
            yield event
            if isinstance(event, inf_ev.InferletEnd):
                self.requester._runs.pop(self.instance, None)
                return
        raise RuntimeError(f"the engine stopped before inferlet {self.instance} ended")

    async def outcome(self, on_event: Any = None) -> InferletOutcome:
        """Waits for the end, handing every other lifecycle event to `on_event`."""
        async for event in self.stream():
            if isinstance(event, inf_ev.InferletEnd):
                return outcome_of(event)
            if on_event is not None:
                on_event(event)
        raise AssertionError("stream() ends with an InferletEnd or raises")

    async def send(self, text: str | None = None, data: bytes | None = None) -> None:
        """A message for the inferlet's `session.receive`."""
        await self.requester.call(
            "inferlets", inf_ev.SendToInferlet, instance=self.instance, text=text, data=data
        )

    async def terminate(self) -> None:
        await self.requester.call("inferlets", inf_ev.TerminateInferlet, instance=self.instance)


class _Reply:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: Any = None


class Requester:
    """Start with `await nursery.start(requester.run)`; `close()` ends it."""

    def __init__(
        self, router: Router, address: str, corr_ids: Iterator[int], *, kv: str = "kv"
    ) -> None:
        """`kv`: the kv actor of the model whose contexts this requester works with."""
        self.router = router
        self.address = address
        self.kv = kv
        self._corr = corr_ids
        self._inbox = router.register(address, REPLIES, capacity=65536)
        self._waiting: dict[int, _Reply] = {}
        self._topics: dict[int, Callable[[bus_ev.TopicMessage], None]] = {}
        self._runs: dict[str, tuple[trio.MemorySendChannel[Any], trio.MemoryReceiveChannel[Any]]]
        self._runs = {}
        self._last = CAUSE.get()
        """The seq of the latest delivery to this requester, the cause of its next command:
        whoever drives it decided on what it had received (first: what it was opened in)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            async for seq, event in self._inbox:
                self._last = seq or self._last
                self._deliver(event)

    def _deliver(self, event: Any) -> None:
        if isinstance(event, inf_ev.InferletLaunched):
            # Opened here, before the launcher resumes, so no lifecycle event can miss it.
            self._runs[event.instance] = trio.open_memory_channel[Any](math.inf)
        elif _is_lifecycle(event):
            run = self._runs.get(event.instance)
            if run is not None:
                run[0].send_nowait(event)
            return
        if isinstance(event, bus_ev.TopicMessage):
            deliver = self._topics.get(event.corr)
            if deliver is not None:
                deliver(event)
            return
        reply = self._waiting.pop(event.corr, None)
        if reply is not None:
            reply.value = event
            reply.done.set()

    async def call(self, dst: str, make: Any, **fields: Any) -> Any:
        """Sends `make(corr=..., requester=..., **fields)` to `dst` and returns the reply."""
        return await self._exchange(
            dst, make(corr=next(self._corr), requester=self.address, **fields)
        )

    async def _exchange(self, dst: str, event: Any) -> Any:
        """Sends a command and waits for the reply with its correlation id."""
        reply = _Reply()
        self._waiting[event.corr] = reply
        try:
            await self.router.send(self.address, dst, event, cause=self._last)
            await reply.done.wait()
        finally:
            self._waiting.pop(event.corr, None)
        if isinstance(reply.value, kv_ev.RequestFailed):
            raise RequestRefused(reply.value.kind, reply.value.message)
        return reply.value

    # -- contexts ----------------------------------------------------------------------------

    async def create_context(self, user: str = "local") -> int:
        return (await self.call(self.kv, kv_ev.CreateContext, user=user)).context

    async def fork(self, context: int) -> int:
        return (await self.call(self.kv, kv_ev.ForkContext, context=context)).context

    async def destroy(self, context: int) -> None:
        await self.call(self.kv, kv_ev.DestroyContext, context=context)

    async def save(self, context: int, name: str, user: str = "local") -> None:
        await self.call(self.kv, kv_ev.SaveContext, context=context, name=name, user=user)

    async def open(self, name: str, user: str = "local", take: bool = False) -> int:
        opened = await self.call(self.kv, kv_ev.OpenContext, name=name, user=user, take=take)
        return opened.context

    async def delete_snapshot(self, name: str, user: str = "local") -> None:
        await self.call(self.kv, kv_ev.DeleteSnapshot, name=name, user=user)

    async def truncate(self, context: int, count: int) -> None:
        await self.call(self.kv, kv_ev.TruncateContext, context=context, count=count)

    async def reserve(self, context: int, count: int) -> None:
        """Takes now the pages `count` more tokens will need, so later passes allocate none."""
        await self.call(self.kv, kv_ev.ReserveTokens, context=context, count=count)

    async def mask_pages(self, context: int, pages: tuple[int, ...], masked: bool = True) -> None:
        pages = tuple(pages)
        await self.call(self.kv, kv_ev.MaskPages, context=context, pages=pages, masked=masked)

    async def release_pages(self, context: int, pages: tuple[int, ...]) -> None:
        await self.call(self.kv, kv_ev.ReleasePages, context=context, pages=tuple(pages))

    async def describe(self, context: int) -> kv_ev.ContextInfo:
        info: kv_ev.ContextInfo = await self.call(self.kv, kv_ev.DescribeContext, context=context)
        return info

    async def forward(
        self,
        context: int,
        tokens: list[int] | tuple[int, ...],
        slots: tuple[SamplingSlot, ...] = (),
        *,
        positions: tuple[int, ...] | None = None,
        attention_masks: tuple[Rle, ...] | None = None,
        logit_mask: Rle | None = None,
        adapter: str | None = None,
    ) -> tuple[SlotOutput, ...]:
        """Appends `tokens` to the context in one pass (through LoRA `adapter` when named) and
        returns one output per slot."""
        done: ForwardCompleted = await self.call(
            self.kv,
            kv_ev.SubmitForward,
            context=context,
            tokens=tuple(tokens),
            positions=positions,
            attention_masks=attention_masks,
            logit_mask=logit_mask,
            slots=tuple(slots),
            adapter=adapter,
        )
        return done.outputs

    # -- messaging ---------------------------------------------------------------------------

    async def push(self, queue: str, message: str) -> None:
        await self.call("bus", bus_ev.Push, queue=queue, message=message)

    async def pull(self, queue: str) -> str:
        return (await self.call("bus", bus_ev.Pull, queue=queue)).message

    async def publish(self, topic: str, message: str) -> None:
        await self.call("bus", bus_ev.Publish, topic=topic, message=message)

    async def subscribe(self, topic: str, deliver: Callable[[bus_ev.TopicMessage], None]) -> None:
        """Calls `deliver` with every message published on `topic` from now on, in order and
        none dropped, from this requester's task (so it must not block); the subscription
        ends when the requester closes."""
        event = bus_ev.Subscribe(corr=next(self._corr), requester=self.address, topic=topic)
        self._topics[event.corr] = deliver
        try:
            await self._exchange("bus", event)
        except BaseException:
            del self._topics[event.corr]
            raise

    # -- inferlets ----------------------------------------------------------------------------

    async def launch(
        self,
        program: str,
        input: str,
        user: str = "local",
        request: inf_ev.IncomingRequest | None = None,
    ) -> InferletRun:
        """Starts an inferlet (its `handle` export when `request` is given); its events and
        outcome come through the returned run."""
        launched: inf_ev.InferletLaunched = await self.call(
            "inferlets",
            inf_ev.LaunchInferlet,
            program=program,
            input=input,
            user=user,
            request=request,
        )
        return InferletRun(self, launched.instance, launched.queued)

    async def close(self) -> None:
        """Releases every context this requester owns and leaves the bus."""
        with trio.move_on_after(5, shield=True):
            for instance in list(self._runs):
                # An inferlet does not outlive the requester that launched it.
                with contextlib.suppress(RequestRefused):  # it may have ended already
                    await self.call("inferlets", inf_ev.TerminateInferlet, instance=instance)
            await self.call(self.kv, kv_ev.ReleaseRequester)
            await self.call("bus", bus_ev.LeaveBus)
        self.router.unregister(self.address)
        self._topics.clear()


_LIFECYCLE = (
    inf_ev.InferletStarted,
    inf_ev.InferletOutput,
    inf_ev.SessionMessage,
    inf_ev.ResponseStarted,
    inf_ev.ResponseBody,
    inf_ev.InferletReturned,
    inf_ev.InferletFailed,
    inf_ev.InferletTerminated,
)

REPLIES = (
    ForwardCompleted,
    kv_ev.Done,
    kv_ev.RequestFailed,
    kv_ev.ContextCreated,
    kv_ev.ContextInfo,
    kv_ev.SnapshotLent,
    kv_ev.PagesPlaced,
    bus_ev.Pulled,
    bus_ev.TopicMessage,
    inf_ev.InferletLaunched,
    _LIFECYCLE,
)
"""What a requester's mailbox takes: the answers of the kv, bus and inferlet actors (and of the
inference actor, for passes) and the lifecycle of the inferlets it launched."""


def _is_lifecycle(event: Any) -> bool:
    return isinstance(event, _LIFECYCLE)


def correlation_ids() -> Iterator[int]:
    """The engine-wide source of correlation ids (one per request, never reused)."""
    return itertools.count(1)
