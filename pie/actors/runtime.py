"""The actor runtime: addressed bounded mailboxes, each accepting one closed union of event
types, a router that logs every delivery with the delivery that caused it, and the Actor base
class every shell builds on."""

from __future__ import annotations

import sys
import traceback
import types
import typing
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeAlias

import trio
from attrs import define, frozen

from pie.eventlog.log import EventLog
from pie.events.kv import RequestFailed


class MailboxOverrun(RuntimeError):
    """A reply edge found its destination's mailbox full (it would otherwise deadlock)."""


class UnknownAddress(LookupError):
    """No actor or requester is registered under this address."""


class UnexpectedEvent(TypeError):
    """An event sent to a mailbox that does not accept its type: a bug in the sender."""


CAUSE: ContextVar[int | None] = ContextVar("pie_cause", default=None)
"""The seq of the delivery the current task is handling: what it sends was caused by it."""

Delivery: TypeAlias = tuple[int, Any]
"""What a mailbox's channel carries: (the delivery's seq in the log, 0 without one; the event)."""

Accepts: TypeAlias = type | types.UnionType | tuple[Any, ...]
"""What a mailbox accepts: an event class, a union of them (`A | B`), or a tuple nesting both."""


def event_types(accepts: Accepts) -> tuple[type, ...]:
    """`accepts` as one flat tuple of classes, so that checking an event is one `isinstance`."""
    if isinstance(accepts, type):
        return (accepts,)
    if isinstance(accepts, tuple):
        members: tuple[Any, ...] = accepts
    elif typing.get_origin(accepts) in (typing.Union, types.UnionType):
        members = typing.get_args(accepts)
    else:
        raise TypeError(f"not an event class or a union of them: {accepts!r}")
    return tuple(dict.fromkeys(cls for member in members for cls in event_types(member)))


@frozen(kw_only=True)
class MailboxStatistics:
    address: str
    received: int
    queued: int
    capacity: int


@define
class _Mailbox:
    send: trio.MemorySendChannel[Any]
    receive: trio.MemoryReceiveChannel[Any]
    capacity: int
    accepts: tuple[type, ...]
    delivered: int = 0
    handler: Callable[[Any], None] | None = None
    """Set for addresses that take deliveries synchronously instead of through the channel."""
    last_seq: int = 0
    """The seq of the latest delivery (0 without a log)."""


class Router:
    """Delivers events between addresses. Every delivery is appended to the event log.

    Each mailbox accepts one closed union of event types; `send` and `send_nowait` raise
    `UnexpectedEvent` at the sender for any other, before anything is logged or delivered.
    A delivery's cause is the `cause` its sender names, else the delivery the sending task is
    handling (`CAUSE`); channels carry each event with its own seq, so that the receiver can
    name it as the cause of what it sends in turn.
    """

    def __init__(self, log: EventLog | None = None) -> None:
        self._boxes: dict[str, _Mailbox] = {}
        self.log = log

    def register(
        self, address: str, accepts: Accepts, capacity: int = 1024
    ) -> trio.MemoryReceiveChannel[Delivery]:
        """A mailbox at `address` taking only events of the types in `accepts`; its channel
        yields `(seq, event)` deliveries."""
        if address in self._boxes:
            raise ValueError(f"address {address!r} is already registered")
        classes = event_types(accepts)
        if not classes:
            raise ValueError(f"the mailbox at {address!r} accepts no event type")
        send, receive = trio.open_memory_channel[Any](capacity)
        self._boxes[address] = _Mailbox(send, receive, capacity, classes)
        return receive

    def register_handler(
        self, address: str, accepts: Accepts, handler: Callable[[Any], None]
    ) -> None:
        """An address whose deliveries call `handler(event)` on the Trio thread at once.

        For addresses that only hand events to another thread: it saves a task switch per event.
        `handler` must not block or raise.
        """
        self.register(address, accepts, capacity=1).close()
        self._boxes[address].handler = handler

    def accepts(self, address: str) -> tuple[type, ...]:
        """The event classes the mailbox at `address` accepts."""
        return self._box(address).accepts

    def unregister(self, address: str) -> None:
        box = self._boxes.pop(address, None)
        if box is not None:
            box.send.close()

    def __contains__(self, address: str) -> bool:
        return address in self._boxes

    async def send(self, src: str, dst: str, event: Any, *, cause: int | None = None) -> None:
        """Delivers, waiting while the mailbox is full (use for command edges)."""
        box = self._box(dst)
        if not isinstance(event, box.accepts):
            raise _unexpected(dst, event, box)
        # A sender cancelled before the hand-off must leave no record, or replay would feed
        # the receiver an event it never saw. Past this check trio's `send` can only be
        # cancelled after the hand-off, unless the mailbox is full and it has to wait.
        await trio.lowlevel.checkpoint_if_cancelled()
        seq = self._record(src, dst, event, box, cause)
        if box.handler is not None:
            box.handler(event)
            return
        await box.send.send((seq, event))

    def send_nowait(self, src: str, dst: str, event: Any, *, cause: int | None = None) -> bool:
        """Delivers at once (use for reply edges). A vanished destination drops the event
        and returns False; a full mailbox raises MailboxOverrun. Only deliveries are logged."""
        box = self._boxes.get(dst)
        if box is None:
            return False
        if not isinstance(event, box.accepts):
            raise _unexpected(dst, event, box)
        if box.handler is not None:
            self._record(src, dst, event, box, cause)
            box.handler(event)
            return True
        # The seq is taken before the hand-off so that the channel carries it; a refused
        # hand-off gives it back, leaving no record and no hole in the log.
        seq = self.log.next_seq if self.log is not None else 0
        try:
            box.send.send_nowait((seq, event))
        except trio.WouldBlock:
            raise MailboxOverrun(f"mailbox of {dst!r} is full ({box.capacity})") from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        self._record(src, dst, event, box, cause)
        return True

    def last_delivered(self, address: str) -> int:
        """The seq of the latest delivery to `address` (0 when none was logged)."""
        box = self._boxes.get(address)
        return box.last_seq if box is not None else 0

    def statistics(self) -> list[MailboxStatistics]:
        return [
            MailboxStatistics(
                address=address,
                received=box.delivered,
                queued=box.send.statistics().current_buffer_used,
                capacity=box.capacity,
            )
            for address, box in self._boxes.items()
        ]

    def close(self) -> None:
        for box in self._boxes.values():
            box.send.close()

    def _box(self, dst: str) -> _Mailbox:
        try:
            return self._boxes[dst]
        except KeyError:
            raise UnknownAddress(f"no actor at {dst!r}") from None

    def _record(self, src: str, dst: str, event: Any, box: _Mailbox, cause: int | None) -> int:
        box.delivered += 1
        if self.log is None:
            return 0
        if cause is None:
            cause = CAUSE.get()
        box.last_seq = seq = self.log.append(src, dst, event, cause)
        return seq


def internal_failure(event: Any) -> tuple[str, Any] | None:
    """Where to tell that `event` could not be handled, and what: a `RequestFailed` of kind
    `internal` to the requester it names, or None when it names none."""
    requester, corr = getattr(event, "requester", None), getattr(event, "corr", None)
    if not isinstance(requester, str) or not isinstance(corr, int):
        return None
    message = "the engine failed on this request (the server's log has the details)"
    return requester, RequestFailed(corr=corr, kind="internal", message=message)


def _unexpected(dst: str, event: Any, box: _Mailbox) -> UnexpectedEvent:
    accepted = ", ".join(cls.__name__ for cls in box.accepts)
    kind = type(event).__name__
    return UnexpectedEvent(f"the mailbox at {dst!r} does not accept {kind}; it accepts {accepted}")


class Actor:
    """An addressed mailbox and a loop that hands each event to `handle`.

    Subclasses set `accepts`, the closed union of event types their mailbox takes, and implement
    `handle` (usually: feed the event to a pure core, send its outputs). Start with
    `await nursery.start(actor.run)`; the loop ends when the mailbox is closed.
    """

    accepts: Accepts

    def __init__(self, address: str, router: Router, capacity: int = 1024) -> None:
        self.address = address
        self.router = router
        self._inbox = router.register(address, self.accepts, capacity)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.started()
        task_status.started()
        async with self._inbox:
            async for seq, event in self._inbox:
                cause = CAUSE.set(seq or None)
                try:
                    await self.handle(event)
                except Exception as exc:  # one request's failure must not stop the engine
                    self.handler_failed(event, exc)
                finally:
                    CAUSE.reset(cause)

    async def started(self) -> None:
        """Hook run before readiness is reported."""

    async def handle(self, event: Any) -> None:
        raise NotImplementedError

    def handler_failed(self, event: Any, exc: Exception) -> None:
        """`handle` raised on `event`: the traceback goes to the server's log and the event's
        requester, when it names one, gets an `internal` failure; the actor goes on with its
        next event."""
        print(
            f"{self.address}: handling {type(event).__name__} failed",
            "".join(traceback.format_exception(exc)),
            file=sys.stderr,
            sep="\n",
        )
        failed = internal_failure(event)
        if failed is not None:
            requester, reply = failed
            try:
                self.router.send_nowait(self.address, requester, reply)
            except (UnknownAddress, MailboxOverrun, UnexpectedEvent):
                pass  # the requester is gone, swamped or takes no failures: the log has it

    def emit(self, outputs: list[tuple[str, Any]]) -> None:
        """Sends a core's outputs; actor-to-actor edges in pie are replies, so never block."""
        for dst, event in outputs:
            self.router.send_nowait(self.address, dst, event)


class CoreActor(Actor):
    """An actor whose whole behaviour is a pure core: `core.handle(event)` returns the
    (destination, event) pairs to send; `core.accepts` is what it handles; `core.statistics()`
    describes it."""

    def __init__(self, core: Any, address: str, router: Router, capacity: int = 65536) -> None:
        self.accepts = core.accepts
        super().__init__(address, router, capacity)
        self.core = core

    async def handle(self, event: Any) -> None:
        self.emit(self.core.handle(event))

    def statistics(self) -> Any:
        return self.core.statistics()
