"""Replaying a recorded instance: a linker whose every host function takes the next recorded
call, checks that the guest asks the same thing, and answers with the recorded result; no
model, no network, no engine. The first difference stops the guest."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from attrs import frozen
from wasmtime.component import Component, Linker

from pie.sandbox.callvalues import RecordedRaise, decode, dumps, encode_args
from pie.sandbox.host import add_inferlet_api
from pie.sandbox.recording import call_name
from pie.sandbox.runtime import (
    GuestStopped,
    KillSwitch,
    RunOutcome,
    SandboxLimits,
    StopStatus,
    WasmRuntime,
)
from pie.sandbox.wasi_values import add_stand_ins, replaced_imports

RecordedCall = Sequence[Any]
"""[function, arguments, result] as recorded (JSON data, see callvalues)."""


@frozen(kw_only=True)
class Divergence:
    """Where the replayed program first did something other than the recorded one: `index` is
    the call's number (from 0); an empty function means there was no call (the recording or the
    program ended)."""

    index: int
    expected_fn: str
    expected_args: str
    seen_fn: str
    seen_args: str


class ReplayStopped(GuestStopped):
    """Raised in the guest by the replay host: the replay cannot go on (the reason says why)."""

    def __init__(self, reason: str) -> None:
        super().__init__("failed", reason)


class Replayer:
    """Answers host calls from a recording. `past_end`: why the recording holds nothing past its
    last call when it was cut short (a size cap, a hole in the log), None when the instance
    ended there; `stopped_at_end`: the stop (killed, timeout) that ended the recorded run while
    the guest ran its own code after the last call."""

    def __init__(
        self,
        calls: Sequence[RecordedCall],
        *,
        past_end: str | None = None,
        stopped_at_end: GuestStopped | None = None,
    ) -> None:
        self.calls = calls
        self.past_end = past_end
        self.stopped_at_end = stopped_at_end
        self.position = 0
        self.divergence: Divergence | None = None
        self.ran_out = False
        """The guest went past a recording that was cut short."""
        self._first_at = self._last_at = 0.0

    @property
    def calls_per_second(self) -> float:
        """Calls answered a second, from the first call to the last (the guest's start and end
        left out)."""
        span = self._last_at - self._first_at
        return (self.position - 1) / span if self.position > 1 and span > 0 else 0.0

    @property
    def exhausted(self) -> bool:
        return self.position == len(self.calls)

    def wrap(self, interface: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        call = call_name(interface, name)
        return lambda *args: self.answer(call, args)

    def answer(self, fn: str, args: tuple[Any, ...]) -> Any:
        self._last_at = time.perf_counter()
        if not self.position:
            self._first_at = self._last_at
        seen = dumps(encode_args(args))
        if self.position >= len(self.calls):
            self._past_the_end(fn, seen)
        want_fn, want_args, result = self.calls[self.position]
        expected = dumps(want_args)
        if (want_fn, expected) != (fn, seen):
            self._diverge(want_fn, expected, fn, seen)
        self.position += 1
        raised = RecordedRaise.decode(result)
        if raised is not None:
            raise raised.exception()
        return decode(result)

    def finish(self) -> None:
        """The guest has ended: recorded calls it never made are a divergence."""
        if self.divergence is None and not self.ran_out and not self.exhausted:
            want_fn, want_args, _ = self.calls[self.position]
            self.divergence = Divergence(
                index=self.position,
                expected_fn=want_fn,
                expected_args=dumps(want_args),
                seen_fn="",
                seen_args="",
            )

    def _past_the_end(self, fn: str, seen: str) -> None:
        if self.past_end is not None:
            self.ran_out = True
            raise ReplayStopped(f"cannot replay past call {self.position}: {self.past_end}")
        if self.stopped_at_end is not None:
            raise self.stopped_at_end
        self._diverge("", "", fn, seen)

    def _diverge(self, want_fn: str, want_args: str, fn: str, seen: str) -> None:
        self.divergence = Divergence(
            index=self.position,
            expected_fn=want_fn,
            expected_args=want_args,
            seen_fn=fn,
            seen_args=seen,
        )
        raise ReplayStopped(f"the program diverged from its recording at call {self.position}")


def replay_linker(runtime: WasmRuntime, component: Component, replayer: Replayer) -> Linker:
    linker = runtime.new_linker()
    add_inferlet_api(linker, replayer.wrap)
    add_stand_ins(linker, replaced_imports(component, runtime.engine), replayer.wrap)
    return linker


@frozen(kw_only=True)
class Replayed:
    outcome: RunOutcome
    calls: int
    """Host calls answered from the recording."""
    seconds: float


def replay(
    runtime: WasmRuntime,
    component: Component,
    replayer: Replayer,
    input: str,
    *,
    request: Any = None,
    on_output: Callable[[str, bytes], None],
    limits: SandboxLimits | None = None,
) -> Replayed:
    """Runs `component` (its `run(input)`, or `handle(request)`) against `replayer`'s recording
    on this thread; `replayer.divergence` says where it first differed, if it did."""
    linker = replay_linker(runtime, component, replayer)
    started = time.perf_counter()
    outcome = runtime.run(
        component,
        linker,
        input,
        limits=limits or SandboxLimits(budget_seconds=3600.0, memory_bytes=512 << 20),
        kill=KillSwitch(),
        on_output=on_output,
        request=request,
    )
    seconds = time.perf_counter() - started
    replayer.finish()
    return Replayed(outcome=outcome, calls=replayer.position, seconds=seconds)


def stop_of(status: str, reason: str) -> GuestStopped | None:
    """The stop that ended a recorded run with `status`, when something outside the program
    stopped it (a kill, its time budget or its directory quota)."""
    stops: tuple[StopStatus, ...] = ("killed", "timeout", "quota")
    for stop in stops:
        if status == stop:
            return GuestStopped(stop, reason)
    return None
