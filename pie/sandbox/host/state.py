"""One inferlet instance as its host functions see it: handle tables, pollables, and the
bridge to the engine. Guest-thread methods block on a condition; `deliver` runs on the Trio
thread and never blocks."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pie.events import bus as bus_ev
from pie.events import inferlet as inf_ev
from pie.events.kv import RequestFailed
from pie.sandbox.host.failure import HostFailure
from pie.sandbox.host.matchertable import MatcherTable
from pie.sandbox.host.ports import Bridge, LaunchTrace
from pie.sandbox.host.records import Child, ModelView, Pending
from pie.sandbox.host.runtable import RunTable
from pie.sandbox.host.topics import TopicBuffers
from pie.sandbox.runtime import GuestStopped, KillSwitch
from pie.sandbox.values import Err, Ok
from pie.sandbox.wasm import record


class InstanceState:
    def __init__(
        self,
        *,
        instance: str,
        address: str,
        user: str,
        bridge: Bridge,
        models: list[ModelView],
        kill: KillSwitch,
        corr: Iterator[int],
        budget_seconds: float,
        version: str,
        subscription_buffer: int = 1024,
        subscription_bytes: int = 16 << 20,
        subscriptions_bytes: int = 64 << 20,
        max_matchers: int = 64,
        max_media: int = 64,
        trace: LaunchTrace | None = None,
    ) -> None:
        self.instance = instance
        self.trace = trace
        """The launch's spans when it is traced: host-call families open theirs here."""
        self.media: dict[int, tuple[int, Any]] = {}
        """Media handles: (model handle, the store's item)."""
        self.max_media = max_media
        self.clips: dict[int, Any] = {}
        """Speech clips (pie.media.speech.SpeechClip) by handle."""
        self.address = address
        self.user = user
        self.bridge = bridge
        self.models = models
        self.kill = kill
        self.version = version
        self.deadline = time.monotonic() + budget_seconds
        self.topics = TopicBuffers(
            messages=subscription_buffer,
            subscription_bytes=subscription_bytes,
            total_bytes=subscriptions_bytes,
        )
        self.response: Any = None
        """An HTTP-served instance's response (host.serving.Response); None otherwise."""
        self.while_idle: tuple[float, Callable[[], None]] | None = None
        """(seconds, work): work the guest thread does once a wait for a reply has lasted that
        long (a recorder's encoding); a wait for a pass is over before."""
        self._corr = corr
        self._cond = threading.Condition()
        self._next_handle = 1
        self.pollables: dict[int, Pending] = {}
        self._by_corr: dict[int, int] = {}
        self.children: dict[int, Child] = {}
        self._child_by_corr: dict[int, int] = {}
        self._child_by_instance: dict[str, int] = {}
        self._session: collections.deque[inf_ev.SessionInput] = collections.deque()
        self._session_waiting: collections.deque[int] = collections.deque()
        self._callbacks: dict[int, Callable[[Any], None]] = {}
        self.runs = RunTable(self._cond, self._new_pollable, self._fill, self._alive)
        self.grammar = MatcherTable(user, max_matchers, self.new_handle)
        kill.add_waker(self._wake)

    # -- guest thread --------------------------------------------------------------------

    def model_of(self, context: int) -> ModelView:
        """The model a context belongs to: the engine numbers each model's contexts apart
        (model k of n holds the ids k + 1, k + 1 + n, ...)."""
        return self.models[(context - 1) % len(self.models)]

    def next_corr(self) -> int:
        return next(self._corr)

    def new_handle(self) -> int:
        handle = self._next_handle
        self._next_handle += 1
        return handle

    def submit(self, dst: str, event: Any, kind: str, handle: int = 0) -> int:
        """Sends a command whose reply fills a new pollable (`handle`, when a caller took it
        from `new_handle` beforehand); returns the pollable."""
        handle = handle or self.new_handle()
        with self._cond:
            self.pollables[handle] = Pending(kind)
            self._by_corr[event.corr] = handle
        self.bridge.post(dst, event)
        return handle

    def submit_to(self, dst: str, event: Any, deliver: Callable[[Any], None]) -> None:
        """Sends a command whose reply is handed to `deliver` (on the Trio thread)."""
        with self._cond:
            self._callbacks[event.corr] = deliver
        self.bridge.post(dst, event)

    def expect(self, kind: str) -> tuple[int, Callable[[Any], None]]:
        """A new pollable and the function that fills it from any thread."""
        handle = self.new_handle()
        with self._cond:
            self.pollables[handle] = Pending(kind)

        def fill(value: Any) -> None:
            with self._cond:
                self._fill(handle, value)

        return handle, fill

    def request(self, dst: str, event: Any) -> Any:
        """Sends a command and blocks for its reply; a refusal raises HostFailure."""
        handle = self.submit(dst, event, "reply")
        self.wait_any([handle])
        return self.take(handle, "reply")

    def wait_any(self, handles: list[int]) -> list[int]:
        """Blocks until one of `handles` is done; the indices of those done."""
        if not handles:
            raise HostFailure("invalid", "poll needs at least one pollable")
        idle = self.while_idle
        idle_at = time.monotonic() + idle[0] if idle is not None else 0.0
        with self._cond:
            pending = [self._pending(h) for h in handles]
            while True:
                ready = [i for i, p in enumerate(pending) if p.done]
                if ready:
                    return ready
                self._check_alive()
                now = time.monotonic()
                if idle is None or idle_at >= self.deadline:
                    self._cond.wait(timeout=max(0.0, self.deadline - now))
                elif now < idle_at:
                    self._cond.wait(timeout=idle_at - now)
                else:
                    self._idle(idle[1])
                    idle = None

    def _idle(self, work: Callable[[], None]) -> None:
        self._cond.release()  # deliveries go on meanwhile
        try:
            work()
        finally:
            self._cond.acquire()

    def is_ready(self, handle: int) -> bool:
        with self._cond:
            return self._pending(handle).done

    def take(self, handle: int, kind: str) -> Any:
        """The value of a done pollable of `kind`, which is then forgotten."""
        with self._cond:
            pending = self._pending(handle)
            if pending.kind != kind:
                raise HostFailure("invalid", f"pollable {handle} is not a {kind} pollable")
            if not pending.done:
                raise HostFailure("not-ready", f"pollable {handle} is not ready")
            del self.pollables[handle]
        value = pending.value
        if self.trace is not None:
            self.trace.closed(handle, value if isinstance(value, RequestFailed) else None)
        if isinstance(value, RequestFailed):
            raise HostFailure(value.kind, value.message)
        return value

    def discard(self, handle: int) -> None:
        with self._cond:
            self.pollables.pop(handle, None)
        if self.trace is not None:
            self.trace.closed(handle)

    def resolved(self, kind: str, value: Any) -> int:
        """A pollable that is done already."""
        handle = self.new_handle()
        with self._cond:
            self.pollables[handle] = Pending(kind, True, value)
        return handle

    # -- sessions, subscriptions and children (guest thread) ------------------------------

    def session_receive(self) -> int:
        handle = self.new_handle()
        with self._cond:
            self.pollables[handle] = Pending("session")
            self._session_waiting.append(handle)
            self._feed_session()
        return handle

    def subscribe(self, topic: str) -> int:
        event = bus_ev.Subscribe(corr=self.next_corr(), requester=self.address, topic=topic)
        sub = self.new_handle()
        with self._cond:
            self.topics.add(sub, topic, event.corr)
        try:
            self.request("bus", event)
        except HostFailure:
            with self._cond:
                self.topics.remove(sub)
            raise
        return sub

    def next_message(self, sub: int) -> int:
        handle = self.new_handle()
        with self._cond:
            subscription = self.topics.get(sub)
            self.pollables[handle] = Pending("message")
            subscription.waiting.append(handle)
            self.topics.feed(subscription, self._fill)
        return handle

    def unsubscribe(self, sub: int) -> str:
        with self._cond:
            subscription = self.topics.remove(sub)
            for handle in subscription.waiting:
                self._fill(handle, RequestFailed(corr=0, kind="closed", message="unsubscribed"))
        return subscription.topic

    def launch_child(self, event: inf_ev.LaunchInferlet) -> int:
        child = self.new_handle()
        with self._cond:
            self.children[child] = Child()
            self._child_by_corr[event.corr] = child
        try:
            reply = self.request("inferlets", event)
        except HostFailure:
            with self._cond:
                del self.children[child]
                self._child_by_corr.pop(event.corr, None)
            raise
        assert self.children[child].instance == reply.instance
        return child

    def wait_child(self, child: int) -> int:
        handle = self.new_handle()
        with self._cond:
            entry = self._child(child)
            self.pollables[handle] = Pending("child")
            entry.waiting.append(handle)
            self._settle_child(entry)
        return handle

    def child_instance(self, child: int) -> str:
        with self._cond:
            entry = self._child(child)
            if entry.instance is None:
                raise HostFailure("invalid", f"child {child} has not started")
            return entry.instance

    def _alive(self) -> None:
        with self._cond:
            self._check_alive()

    def _new_pollable(self, kind: str, value: Any) -> int:
        handle = self.new_handle()
        self.pollables[handle] = Pending(kind, value=value)
        return handle

    # -- Trio thread ---------------------------------------------------------------------

    def deliver(self, event: Any) -> None:
        callback = None
        with self._cond:
            match event:
                case bus_ev.TopicMessage():
                    self.topics.message(event, self._fill)
                case inf_ev.SessionInput():
                    self._session.append(event)
                    self._feed_session()
                case (
                    inf_ev.InferletReturned()
                    | inf_ev.InferletFailed()
                    | inf_ev.InferletTerminated()
                ):
                    self._child_ended(event)
                case inf_ev.InferletStarted() | inf_ev.InferletOutput() | inf_ev.SessionMessage():
                    pass
                case inf_ev.InferletLaunched():
                    # Registered here, not on the guest thread, so that a child's end can
                    # never arrive before the parent knows the child's instance id.
                    child = self._child_by_corr.pop(event.corr, None)
                    if child is not None:
                        self.children[child].instance = event.instance
                        self._child_by_instance[event.instance] = child
                    self._fill(self._by_corr.pop(event.corr, -1), event)
                case _:
                    corr = getattr(event, "corr", -1)
                    callback = self._callbacks.pop(corr, None)
                    handle = self._by_corr.pop(corr, None)
                    if handle is not None:
                        self._fill(handle, event)
        if callback is not None:
            callback(event)

    # -- internals (callers hold the condition) -------------------------------------------

    def _fill(self, handle: int, value: Any) -> None:
        pending = self.pollables.get(handle)
        if pending is not None:
            pending.done = True
            pending.value = value
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _check_alive(self) -> None:
        if self.kill.killed:
            raise GuestStopped(
                "killed", f"inferlet {self.instance} was stopped: {self.kill.reason}"
            )
        if time.monotonic() >= self.deadline:
            raise GuestStopped("timeout", f"inferlet {self.instance} ran out of its time budget")

    def _pending(self, handle: int) -> Pending:
        pending = self.pollables.get(handle)
        if pending is None:
            raise HostFailure("no-such-handle", f"no pollable {handle}")
        return pending

    def _child(self, child: int) -> Child:
        entry = self.children.get(child)
        if entry is None:
            raise HostFailure("no-such-handle", f"no child {child}")
        return entry

    def _feed_session(self) -> None:
        while self._session and self._session_waiting:
            message = self._session.popleft()
            self._fill(self._session_waiting.popleft(), message)
            size = inf_ev.session_size(message.text, message.data)
            # The inferlet actor counts what the instance holds unread ([sandbox] max_session_*).
            self.bridge.post("inferlets", inf_ev.SessionReceived(instance=self.instance, size=size))

    def _child_ended(self, event: inf_ev.InferletEnd) -> None:
        child = self._child_by_instance.get(event.instance)
        if child is not None:
            self.children[child].end = event
            self._settle_child(self.children[child])

    def _settle_child(self, entry: Child) -> None:
        if entry.end is None:
            return
        for handle in entry.waiting:
            self._fill(handle, entry.end)
        entry.waiting.clear()


_current = threading.local()


def current() -> InstanceState:
    """The instance whose guest runs on this thread."""
    state: InstanceState | None = getattr(_current, "state", None)
    if state is None:
        raise RuntimeError("no inferlet instance runs on this thread")
    return state


def bind(state: InstanceState | None) -> None:
    _current.state = state


def host_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a host function returning `result<T, error>`: HostFailure becomes the error."""

    def call(*args: Any) -> Any:
        try:
            return Ok(fn(*args))
        except HostFailure as failure:
            return Err(record(kind=failure.kind, message=failure.message))

    call.__name__ = fn.__name__
    return call
