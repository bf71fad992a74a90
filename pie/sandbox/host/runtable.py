"""An instance's generation runs (runs.py): at most one per context, each with the pollables its
program waits on. It shares the instance's condition and pollables (state.py), and is reached
from the guest's thread, but for `progressed`, which any thread that delivers a pass calls."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pie.events.kv import RequestFailed
from pie.sandbox.host.failure import HostFailure
from pie.sandbox.host.runs import Run


class RunTable:
    def __init__(
        self,
        cond: threading.Condition,
        new_pollable: Callable[[str, Any], int],
        fill: Callable[[int, Any], None],
        alive: Callable[[], None],
    ) -> None:
        """`new_pollable` and `fill` are called with `cond` held; `alive` raises when the
        program must stop waiting."""
        self._cond = cond
        self._new_pollable = new_pollable
        self._fill = fill
        self._alive = alive
        self._runs: dict[int, Run] = {}
        self._on_context: dict[int, int] = {}
        self._waiting: dict[int, list[int]] = {}

    def add(self, handle: int, run: Run) -> None:
        """Registers a run; a context carries one run at a time. An ended run of the context
        whose last output was never read is forgotten, so the runs held stay within contexts."""
        context = run.spec.context
        with self._cond:
            other = self._on_context.get(context)
            if other is not None and self._runs[other].finished is None:
                raise HostFailure("busy", f"context {context} already has a generation run")
            if other is not None:
                del self._runs[other]
                for pollable in self._waiting.pop(other, []):
                    gone = RequestFailed(corr=0, kind="closed", message="a later run replaced it")
                    self._fill(pollable, gone)
            self._runs[handle] = run
            self._on_context[context] = handle
            self._waiting[handle] = []

    def remove(self, handle: int) -> None:
        with self._cond:
            run = self._runs.pop(handle, None)
            self._waiting.pop(handle, None)
            if run is not None and self._on_context.get(run.spec.context) == handle:
                del self._on_context[run.spec.context]

    def get(self, handle: int) -> Run:
        with self._cond:
            run = self._runs.get(handle)
        if run is None:
            raise HostFailure("no-such-handle", f"no generation run {handle}")
        return run

    def next_output(self, handle: int) -> int:
        """A pollable that is ready once the run has output for the program; its value is the
        run's handle."""
        run = self.get(handle)
        with self._cond:
            pollable = self._new_pollable("run", handle)
            self._waiting[handle].append(pollable)
        if run.ready():
            self.progressed(handle)
        return pollable

    def progressed(self, handle: int) -> None:
        """The run has output ready (any thread): wakes the program's first waiting pollable."""
        with self._cond:
            waiting = self._waiting.get(handle)
            if waiting:
                self._fill(waiting.pop(0), handle)

    def end(self, context: int) -> None:
        """Cancels the context's run, if any, and waits until no pass of it is in flight."""
        with self._cond:
            handle = self._on_context.get(context)
            run = self._runs.get(handle) if handle is not None else None
        if run is not None and run.finished is None:
            run.cancel()
            run.wait_settled(self._alive)

    def cancel_all(self) -> None:
        """Ends every run after its pass in flight (the program has ended)."""
        with self._cond:
            runs = list(self._runs.values())
        for run in runs:
            run.cancel()

    def forbid(self, context: int) -> None:
        """Refuses a pass of the program's own on a context that a run is carrying."""
        if not self._on_context:  # the per-token path of programs without runs
            return
        with self._cond:
            handle = self._on_context.get(context)
            if handle is not None and self._runs[handle].finished is None:
                raise HostFailure("busy", f"context {context} has a generation run")
