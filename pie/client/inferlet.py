"""A followed inferlet on the client side: its queue of events, how it ended, and the handle
a caller reads, messages and stops it through."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import trio

from pie.client.errors import PieError
from pie.events import inferlet as ev
from pie.events.inferlet import InferletOutcome, outcome_of
from pie.wire import messages as msg

if TYPE_CHECKING:
    from pie.client.connection import Client

EVENT_BUFFER = 65536
FINAL_EVENTS = (ev.InferletReturned, ev.InferletFailed, ev.InferletTerminated)


@attrs.frozen(kw_only=True)
class ProgramInfo:
    hash: str
    name: str
    version: str
    size: int


Outcome = InferletOutcome
"""How an inferlet ended (the engine's own record of it)."""


class Subscription:
    """One followed inferlet's queue, filled by the connection's reader task. `ended` once the
    final event is queued; `error` says why it closed early (None: ended or detached)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.send, self.receive = trio.open_memory_channel[msg.InferletEvent](EVENT_BUFFER)
        self.ended = False
        self.error: PieError | None = None

    def close(self, error: PieError | None = None) -> None:
        if self.error is None and not self.ended:
            self.error = error
        self.send.close()


class RemoteInferlet:
    """An inferlet this client follows. Read its events with `events()` (or `result()`), one
    reader at a time; `last_seq` is the last event read, for `attach(after=last_seq)`."""

    def __init__(self, client: Client, sub: Subscription, queued: bool = False) -> None:
        self.instance = sub.instance
        self.queued = queued
        self.last_seq = 0
        self.outcome: Outcome | None = None
        self._client = client
        self._sub = sub

    async def next_event(self) -> msg.StreamedEvent | None:
        """The next lifecycle event, or None after the final one (or once detached).
        Raises `ConnectionLost` or `EventsOverflowed` when the stream broke off."""
        if self.outcome is not None:
            return None
        try:
            message = await self._sub.receive.receive()
        except trio.EndOfChannel:
            if self._sub.error is not None:
                raise self._sub.error from None
            return None
        self.last_seq = message.seq
        if isinstance(message.event, FINAL_EVENTS):
            self.outcome = outcome_of(message.event)
        return message.event

    async def events(self) -> AsyncIterator[msg.StreamedEvent]:
        """The lifecycle events, ending after the final one."""
        while (event := await self.next_event()) is not None:
            yield event

    async def result(self) -> Outcome:
        """Reads the events to the end and returns how the inferlet ended."""
        while await self.next_event() is not None:
            pass
        if self.outcome is None:
            raise PieError(f"detached from {self.instance} before it ended")
        return self.outcome

    async def send(self, message: str | bytes) -> None:
        """Text or bytes for the inferlet's `session.receive`."""
        await self._client.send(self.instance, message)

    async def send_file(self, path: Path | str) -> None:
        """A file's bytes as one message (`Client.send_file`)."""
        await self._client.send_file(self.instance, path)

    async def terminate(self) -> None:
        """Asks the server to stop it; the final event (`InferletTerminated`) still follows."""
        await self._client.terminate(self.instance)

    async def detach(self) -> None:
        """Stops following; the inferlet keeps running and events already queued stay readable."""
        if not self._sub.ended:
            await self._client.detach(self.instance)
