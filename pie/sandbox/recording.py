"""Recording an instance's host calls: linkers whose every host function (and the WASI stand-ins
of wasi_values) appends (function, arguments, result) as JSON to the recorder bound to the
calling thread, which hands them on in chunks and stops at its size caps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from attrs import field, frozen, validators
from wasmtime.component import Component, Linker

from pie.sandbox.callvalues import RecordedRaise, Unrecordable, dumps_call, dumps_calls
from pie.sandbox.host import add_inferlet_api
from pie.sandbox.runtime import WasmRuntime
from pie.sandbox.wasi_values import add_stand_ins, replaced_imports

CHUNK_CALLS = 256
CHUNK_BYTES = 256 << 10
CHUNK_SECONDS = 1.0
"""A chunk goes out once it holds this many calls or bytes, or this long after the last one."""

RAW_CALLS = 64
"""Calls kept as made at most: past it they are encoded together, in one pass."""

IDLE_SECONDS = 0.05
"""A guest that has waited this long for a reply has the calls it kept encoded meanwhile, so
that a recording lags a waiting program (for a client, a message) by at most this."""


def call_name(interface: str, name: str) -> str:
    """`forward.step` for `step` of `pie:inferlet/forward@0.1.0`."""
    return f"{interface.partition('@')[0].rpartition('/')[2]}.{name}"


@frozen(kw_only=True)
class RecordingLimits:
    max_bytes: int = field(validator=validators.gt(0))
    """What one instance's recording may hold ([event_log] record_max_mb)."""
    user_bytes: int = field(validator=validators.gt(0))
    """What the recordings of one user's instances may hold together ([event_log]
    record_user_mb)."""


@frozen(kw_only=True)
class Chunk:
    """Calls `first` onwards of one instance, as a JSON array of [function, arguments, result]."""

    first: int
    calls: str
    final: bool = False
    """The instance has ended: no calls follow."""
    stopped: str = ""
    """Why the recording stopped after these calls (a cap), when it did."""


class RecordingBudget:
    """Bytes of recordings each user's instances may produce over the engine's run (the log file
    never shrinks). Thread-safe."""

    def __init__(self, per_user: int) -> None:
        self.per_user = per_user
        self._used: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, user: str, size: int) -> bool:
        with self._lock:
            used = self._used.get(user, 0) + size
            if used > self.per_user:
                return False
            self._used[user] = used
            return True


class Recorder:
    """One instance's recording, fed on its guest thread; `sink` gets each chunk.

    Calls are kept as made and encoded together, `RAW_CALLS` at a time, or when the guest has
    waited `IDLE_SECONDS` for a reply (`encode_pending`, through `InstanceState.while_idle`),
    or when it ends. Encoded one at a time between stretches of guest code, a call cost about
    three times what it costs among others.
    """

    def __init__(
        self,
        sink: Callable[[Chunk], None],
        *,
        max_bytes: int,
        budget: RecordingBudget,
        user: str,
    ) -> None:
        self._sink = sink
        self._max_bytes = max_bytes
        self._budget = budget
        self._user = user
        self._raw: list[tuple[str, tuple[Any, ...], Any]] = []
        self._pending: list[str] = []
        """Encoded calls not sent yet: pieces of a JSON array's body, one or more calls each."""
        self._pending_calls = 0
        self._pending_bytes = 0
        self._first = 0
        self._bytes = 0
        self._flushed_at = time.monotonic()
        self._closed = False
        self.stopped = ""
        """Why recording stopped; empty while it goes on."""

    @property
    def calls(self) -> int:
        return self._first + self._pending_calls + len(self._raw)

    def add(self, fn: str, args: tuple[Any, ...], result: Any) -> None:
        # Host functions return values of their own and never change their arguments, so
        # encoding them later is exact.
        self._raw.append((fn, args, result))
        if len(self._raw) >= RAW_CALLS:
            self.encode_pending()

    def add_raise(self, fn: str, args: tuple[Any, ...], exc: BaseException) -> None:
        self.add(fn, args, RecordedRaise.of(exc))

    def encode_pending(self) -> None:
        """Encodes the calls kept as made, in order, into the recording."""
        raw, self._raw = self._raw, []
        if not raw or self.stopped:
            return
        try:
            body = dumps_calls(raw)[1:-1]
        except Unrecordable:
            body = None
        if body is None or not self._room(len(body) + 1, stop=False):
            self._encode_each(raw)  # finds the call that cannot be recorded, or that fills
            return
        self._keep(body, len(raw), len(body) + 1)

    def _encode_each(self, raw: list[tuple[str, tuple[Any, ...], Any]]) -> None:
        for fn, args, result in raw:
            if self.stopped:
                return
            try:
                text = dumps_call(fn, args, result)
            except Unrecordable as exc:
                self.stop(str(exc))
                return
            if self._room(len(text) + 1):
                self._keep(text, 1, len(text) + 1)

    def stop(self, reason: str) -> None:
        """Records nothing more; the chunk that says so goes out now."""
        if not self.stopped:
            self.stopped = reason
            self._raw = []
            self._flush(final=False)

    def close(self) -> None:
        """The instance has ended: the last chunk goes out."""
        if not self._closed:
            self.encode_pending()
            self._closed = True
            self._flush(final=True)

    def _room(self, size: int, *, stop: bool = True) -> bool:
        """Takes `size` more bytes from this recording's cap and its user's; when they do not
        fit, stops the recording (with `stop`) and returns False."""
        if self._bytes + size > self._max_bytes:
            if stop:
                self.stop(f"the recording reached record_max_mb ({_megabytes(self._max_bytes)})")
            return False
        if not self._budget.take(self._user, size):
            if stop:
                limit = _megabytes(self._budget.per_user)
                self.stop(f"user {self._user!r}'s recordings reached record_user_mb ({limit})")
            return False
        return True

    def _keep(self, text: str, calls: int, size: int) -> None:
        self._bytes += size
        self._pending.append(text)
        self._pending_calls += calls
        self._pending_bytes += size
        if (
            self._pending_calls >= CHUNK_CALLS
            or self._pending_bytes >= CHUNK_BYTES
            or time.monotonic() - self._flushed_at >= CHUNK_SECONDS
        ):
            self._flush(final=False)

    def _flush(self, *, final: bool) -> None:
        calls = "[" + ",".join(self._pending) + "]"
        chunk = Chunk(first=self._first, calls=calls, final=final, stopped=self.stopped)
        self._first += self._pending_calls
        self._pending, self._pending_calls, self._pending_bytes = [], 0, 0
        self._flushed_at = time.monotonic()
        self._sink(chunk)


def _megabytes(size: int) -> str:
    return f"{size / (1 << 20):g} MB"


_bound = threading.local()


def bind_recorder(recorder: Recorder | None) -> None:
    """Makes `recorder` take the host calls made on this thread (None: no recording)."""
    _bound.recorder = recorder


def _recorded(interface: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    call = call_name(interface, name)

    def host(*args: Any) -> Any:
        recorder: Recorder | None = getattr(_bound, "recorder", None)
        if recorder is None or recorder.stopped:
            return fn(*args)
        try:
            result = fn(*args)
        except BaseException as exc:
            recorder.add_raise(call, args, exc)
            raise
        # Recorder.add, inlined: this runs on every host call of every recorded inferlet.
        raw = recorder._raw
        raw.append((call, args, result))
        if len(raw) >= RAW_CALLS:
            recorder.encode_pending()
        return result

    return host


class RecordingLinkers:
    """Linkers whose host functions record, one for each set of WASI imports with stand-ins
    (they are defined by their exact versioned names). Thread-safe."""

    def __init__(self, runtime: WasmRuntime) -> None:
        self._runtime = runtime
        self._linkers: dict[tuple[str, ...], Linker] = {}
        self._lock = threading.Lock()

    def for_component(self, component: Component) -> Linker:
        imports = replaced_imports(component, self._runtime.engine)
        with self._lock:
            linker = self._linkers.get(imports)
            if linker is None:
                linker = self._linkers[imports] = self._build(imports)
        return linker

    def _build(self, imports: tuple[str, ...]) -> Linker:
        linker = self._runtime.new_linker()
        add_inferlet_api(linker, _recorded)
        add_stand_ins(linker, imports, _recorded)
        return linker
