"""Runs one component instance to completion on the calling thread, inside a budget, a
memory cap and a kill switch, and says how it ended."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from attrs import field, frozen, validators
from wasmtime import Config, Engine, Store, WasiConfig, WasmtimeError, _bindings
from wasmtime import _ffi as ffi
from wasmtime.component import Component, Linker, RecordType, ResultType, String, Variant
from wasmtime.component import Func as ComponentFunc

from pie.sandbox.cache import ComponentCache
from pie.sandbox.wasm import (
    describe_error,
    forget_pending,
    install_thread_safe_exceptions,
    raise_pending,
    trap_with,
)

log = logging.getLogger(__name__)

RunStatus = Literal["returned", "failed", "trapped", "killed", "timeout", "memory", "quota"]
StopStatus = Literal["killed", "failed", "timeout", "memory", "quota"]
MIB = 1 << 20
_OOM_MARKERS = ("memory allocation of", "memoryerror", "out of memory", "exceeds memory limits")


@frozen
class SandboxLimits:
    budget_seconds: float = field(default=300.0, validator=validators.gt(0))
    memory_bytes: int = field(default=256 * MIB, validator=validators.gt(0))
    scratch_dir: str | None = None
    """Preopened read-write as /scratch; without it or `data_dir` the guest sees no filesystem."""
    data_dir: str | None = None
    """Preopened read-write as /data."""


@frozen(kw_only=True)
class RunOutcome:
    status: RunStatus
    value: Any = None
    """What `run` (a string) or `handle` (an outgoing-response record) returned, when it
    returned ok."""
    error: str | None = None
    """For people, in one paragraph: the program's own error when it returned err, else what
    stopped it."""
    seconds: float = 0.0

    @property
    def returned(self) -> bool:
        return self.status == "returned"


@frozen(kw_only=True)
class SandboxStatistics:
    running: int
    """Guests inside `run` now."""
    compiled: int
    """Components held compiled in memory."""


class GuestStopped(Exception):
    """Raised by host code (for example when woken by the kill switch) to end the guest."""

    def __init__(self, status: StopStatus = "killed", reason: str = "the guest was stopped"):
        super().__init__(reason)
        self.status: StopStatus = status
        self.reason = reason


class KillSwitch:
    """Set once, from any thread; wakers let host code blocked for the guest notice."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._status: StopStatus = "killed"
        self._wakers: list[Callable[[], None]] = []

    @property
    def killed(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def status(self) -> StopStatus:
        return self._status

    def kill(self, reason: str, status: StopStatus = "killed") -> bool:
        """Stops the guest; False when it was stopped already (the first reason stays)."""
        with self._lock:
            if self._reason is not None:
                return False
            self._status, self._reason = status, reason
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            _call_waker(wake)
        return True

    def add_waker(self, fn: Callable[[], None]) -> None:
        """`fn` runs once, on the killing thread (at once if the switch is set already)."""
        with self._lock:
            if self._reason is None:
                self._wakers.append(fn)
                return
        _call_waker(fn)

    def remove_waker(self, fn: Callable[[], None]) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._wakers.remove(fn)


def _call_waker(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        log.exception("a kill-switch waker failed")


class _Watch:
    """What the epoch callback checks for one running store."""

    def __init__(self, kill: KillSwitch, budget: float) -> None:
        self.kill = kill
        self.budget = budget
        self.deadline = time.monotonic() + budget

    def expire(self) -> None:
        if time.monotonic() >= self.deadline:
            self.kill.kill(f"the program ran past its budget of {self.budget:g} s", "timeout")

    def stop(self) -> GuestStopped | None:
        self.expire()
        if self.kill.killed:
            return GuestStopped(self.kill.status, self.kill.reason or "")
        return None


_WATCHES: dict[int, _Watch] = {}
_watch_ids = itertools.count(1)
_DEADLINE_ARGTYPES = _bindings._wasmtime_store_epoch_deadline_callback.argtypes
_UPDATE_DEADLINE_CONTINUE = 0


@_DEADLINE_ARGTYPES[1]
def _on_deadline(ctx, idx, delta, kind):  # type: ignore[no-untyped-def]
    # Runs on the guest's thread each epoch tick while wasm executes.
    try:
        stop = _WATCHES[idx or 0].stop()
    except BaseException as exc:
        return trap_with(exc, f"the epoch callback failed: {exc}")
    if stop is not None:
        return trap_with(stop, stop.reason)
    delta[0] = 1
    kind[0] = _UPDATE_DEADLINE_CONTINUE
    return 0


@_DEADLINE_ARGTYPES[3]
def _forget_watch(idx):  # type: ignore[no-untyped-def]
    if _WATCHES is not None:
        _WATCHES.pop(idx or 0, None)


class WasmRuntime:
    """One engine with epoch interruption, its component cache, and the epoch ticker."""

    def __init__(self, cache_dir: Path, epoch_interval: float = 0.005) -> None:
        install_thread_safe_exceptions()
        config = Config()
        config.epoch_interruption = True
        self.engine = Engine(config)
        self.cache = ComponentCache(self.engine, cache_dir, config_tag="epoch")
        self.epoch_interval = epoch_interval
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._running: dict[int, _Watch] = {}
        self._running_lock = threading.Lock()

    def start(self) -> None:
        if self._ticker is not None:
            return
        self._stop.clear()
        self._ticker = threading.Thread(target=self._tick, name="wasm-epoch", daemon=True)
        self._ticker.start()

    def close(self) -> None:
        """Stops the ticker; after every run has ended (nothing could stop a guest later)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None

    def __enter__(self) -> WasmRuntime:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> SandboxStatistics:
        with self._running_lock:
            running = len(self._running)
        return SandboxStatistics(running=running, compiled=self.cache.statistics().loaded)

    def new_linker(self) -> Linker:
        """A linker with WASI p2; the caller adds the pie interfaces, all of them before the
        first run (defining while another thread instantiates would race inside wasmtime)."""
        linker = Linker(self.engine)
        linker.add_wasip2()
        return linker

    def _tick(self) -> None:
        while not self._stop.wait(self.epoch_interval):
            self.engine.increment_epoch()
            with self._running_lock:
                watches = list(self._running.values())
            for watch in watches:
                # Guests blocked in host calls run no wasm; their wakers need this.
                watch.expire()

    @contextlib.contextmanager
    def _watching(self, store: Store, watch: _Watch) -> Iterator[None]:
        idx = next(_watch_ids)
        _WATCHES[idx] = watch
        ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), _on_deadline, idx, _forget_watch)
        store.set_epoch_deadline(1)
        with self._running_lock:
            self._running[idx] = watch
        try:
            yield
        finally:
            with self._running_lock:
                del self._running[idx]

    def run(
        self,
        component: Component,
        linker: Linker,
        input: str,
        *,
        limits: SandboxLimits,
        kill: KillSwitch,
        on_output: Callable[[str, bytes], None],
        request: Any = None,
    ) -> RunOutcome:
        """Instantiates `component` in a fresh store and calls its `run(input)` export, or its
        `handle(request)` export when `request` (an incoming-request record) is given, on this
        thread. Many threads may share one linker: instantiating only reads it."""
        if self._ticker is None:
            raise RuntimeError("WasmRuntime.run needs start() first: nothing would stop a guest")
        if linker.locked:
            raise RuntimeError("the linker is still being defined (a LinkerInstance is open)")
        if kill.killed:
            return RunOutcome(status=kill.status, error=kill.reason, seconds=0.0)
        started = time.monotonic()
        forget_pending()
        watch = _Watch(kill, limits.budget_seconds)
        stderr = _Tail()
        store = Store(self.engine)
        try:
            with self._watching(store, watch):
                entry = _Entry("run", input) if request is None else _Entry("handle", request)
                status, value, error = _call(
                    store, component, linker, entry, limits, kill, _Output(on_output, stderr)
                )
        finally:
            store.close()
        return RunOutcome(
            status=status, value=value, error=error, seconds=time.monotonic() - started
        )


class _Tail:
    """The last few KiB a guest wrote to stderr, to recognise an out-of-memory death."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.data = b""

    def add(self, data: bytes) -> None:
        self.data = (self.data + data)[-self.limit :]


class _Output:
    def __init__(self, on_output: Callable[[str, bytes], None], stderr: _Tail) -> None:
        self.on_output = on_output
        self.stderr = stderr

    def writer(self, stream: str) -> Callable[[bytes], None]:
        # Called on a wasmtime thread, not the guest's: never let an exception out.
        def write(data: bytes) -> None:
            if stream == "stderr":
                self.stderr.add(data)
            try:
                self.on_output(stream, data)
            except Exception:
                log.exception("on_output failed; %d bytes of %s dropped", len(data), stream)

        return write


def _prepare(store: Store, limits: SandboxLimits, output: _Output) -> None:
    store.set_limits(memory_size=limits.memory_bytes)
    wasi = WasiConfig()
    wasi.stdout_custom = output.writer("stdout")
    wasi.stderr_custom = output.writer("stderr")
    if limits.scratch_dir is not None:
        wasi.preopen_dir(limits.scratch_dir, "/scratch")
    if limits.data_dir is not None:
        wasi.preopen_dir(limits.data_dir, "/data")
    store.set_wasi(wasi)


Ended = tuple[RunStatus, Any, str | None]


@frozen
class _Entry:
    """The export to call and its one argument."""

    name: Literal["run", "handle"]
    argument: Any


def _call(
    store: Store,
    component: Component,
    linker: Linker,
    entry: _Entry,
    limits: SandboxLimits,
    kill: KillSwitch,
    output: _Output,
) -> Ended:
    try:
        _prepare(store, limits, output)
        export = _start(store, component, linker, entry.name)
    except Exception as exc:
        return _stopped(exc, kill, output.stderr, limits, starting=True)
    try:
        result = export(store, entry.argument)
    except Exception as exc:
        return _stopped(exc, kill, output.stderr, limits, starting=False)
    if not isinstance(result, Variant):
        # Only an ambiguous result<T, E> comes back as a Variant; `handle`'s ok is a record.
        if isinstance(result, str):
            return _failed(result, limits)
        return "returned", result, None
    if result.tag == "ok":
        return "returned", result.payload, None
    return _failed(result.payload, limits)


def _failed(error: Any, limits: SandboxLimits) -> Ended:
    """A program that returned an error; one whose own error is a caught MemoryError (its
    memory.grow was refused at the cap) ran out of memory."""
    if isinstance(error, str) and error.startswith("MemoryError"):
        return "memory", None, f"{_out_of_memory(limits)}: {error}"
    return "failed", None, error


def _out_of_memory(limits: SandboxLimits) -> str:
    return f"the program ran out of memory (cap {_amount(limits.memory_bytes)})"


def _start(store: Store, component: Component, linker: Linker, name: str) -> ComponentFunc:
    try:
        instance = linker.instantiate(store, component)
    except WasmtimeError:
        # wasmtime-py's instantiate does not look at the kept exception; a GuestStopped
        # raised while a start function ran must still say why.
        raise_pending()
        raise
    export = instance.get_func(store, name)
    if export is None:
        served = " (it is not an HTTP-served inferlet)" if name == "handle" else ""
        raise ValueError(f"the program exports no `{name}` function{served}")
    ty = export.type(store)
    params, result = ty.params, ty.result
    takes = String if name == "run" else RecordType
    gives = String if name == "run" else RecordType
    if not (
        len(params) == 1
        and isinstance(params[0][1], takes)
        and isinstance(result, ResultType)
        and isinstance(result.ok, gives)
        and isinstance(result.err, String)
    ):
        expected = _SIGNATURES[name]
        raise ValueError(f"`{name}` must be {expected}")
    return export


_SIGNATURES = {
    "run": "func(input: string) -> result<string, string>",
    "handle": "func(request: incoming-request) -> result<outgoing-response, string>",
}


def _amount(size: int) -> str:
    return f"{size / MIB:g} MiB" if size >= MIB else f"{size} bytes"


def _stopped(
    exc: Exception, kill: KillSwitch, stderr: _Tail, limits: SandboxLimits, *, starting: bool
) -> Ended:
    """How a guest that did not return ended, most specific cause first."""
    if kill.killed:
        return kill.status, None, kill.reason
    if isinstance(exc, GuestStopped):
        return exc.status, None, exc.reason
    text = describe_error(exc) if isinstance(exc, WasmtimeError) else f"{type(exc).__name__}: {exc}"
    said = (str(exc) + stderr.data.decode("utf-8", "replace")).lower()
    if any(marker in said for marker in _OOM_MARKERS):
        return "memory", None, f"{_out_of_memory(limits)}: {text}"
    if starting:
        return "failed", None, f"the program could not start: {text}"
    if isinstance(exc, WasmtimeError):
        return "trapped", None, f"the program trapped: {text}"
    log.warning("a host function failed; the guest was trapped", exc_info=exc)
    return "trapped", None, f"a host function failed: {text}"
