"""The inferlet actor's shell: runs each admitted instance on a thread of its own, bridges
its host calls into the engine, and cleans up after it whatever way it ends."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import trio

from pie.actors.inferlet.core import InferletCore, InferletStatistics, Instance
from pie.actors.inferlet.files import FileLayout, InstanceFiles
from pie.actors.inferlet.programs import Program
from pie.actors.inferlet.recording import InstanceRecordings
from pie.actors.requester import REPLIES
from pie.actors.runtime import CAUSE, Actor, MailboxOverrun, Router
from pie.dataplane.lanes import Lanes
from pie.events import bus as bus_ev
from pie.events import inferlet as ev
from pie.events import kv as kv_ev
from pie.events import mcp as mcp_ev
from pie.events.http import HttpFetched
from pie.sandbox import (
    GuestStopped,
    InvalidProgram,
    KillSwitch,
    RunOutcome,
    SandboxLimits,
    WasmRuntime,
)
from pie.sandbox.host import HostFailure, InstanceState, ModelView, add_inferlet_api, bind, serving
from pie.sandbox.host.media import release_all as release_media
from pie.sandbox.host.speech import release_all as release_speech
from pie.sandbox.recording import IDLE_SECONDS, RecordingLimits, bind_recorder
from pie.sandbox.wasm import record

if TYPE_CHECKING:
    from pie.observe.tracing import Tracing

PROGRAM_INBOX = (
    REPLIES,
    ev.SessionInput,
    HttpFetched,
    mcp_ev.McpServerList,
    mcp_ev.McpToolList,
    mcp_ev.McpToolCalled,
)
"""What a running instance's address takes: a requester's replies, its client's messages and the
answers of the http and mcp actors."""


class TrioBridge:
    """Host calls reach the Trio thread with one `run_sync_soon` each; nothing waits there."""

    def __init__(self, token: trio.lowlevel.TrioToken, router: Router, address: str) -> None:
        self._token = token
        self._router = router
        self._address = address
        self.state: InstanceState | None = None
        self._started_by = CAUSE.get()
        """What started the instance (its launch, or the end that freed its slot): the cause of
        its first commands."""

    def post(self, dst: str, event: Any) -> None:
        try:
            self._token.run_sync_soon(self._send, dst, event)
        except trio.RunFinishedError:
            raise GuestStopped("killed", "the engine has stopped") from None

    def _send(self, dst: str, event: Any) -> None:
        try:
            # The program decided on what it had received: its latest delivery caused this.
            cause = self._router.last_delivered(self._address) or self._started_by
            delivered = self._router.send_nowait(self._address, dst, event, cause=cause)
            reason = f"nothing listens at {dst!r}"
        except MailboxOverrun as exc:
            delivered, reason = False, str(exc)
        corr = getattr(event, "corr", None)
        if not delivered and corr is not None and self.state is not None:
            self.state.deliver(kv_ev.RequestFailed(corr=corr, kind="closed", message=reason))


class InferletActor(Actor):
    accepts = InferletCore.accepts

    def __init__(
        self,
        core: InferletCore,
        router: Router,
        *,
        wasm: WasmRuntime,
        models: list[ModelView],
        limits: SandboxLimits,
        corr: Iterator[int],
        version: str,
        files: FileLayout | None = None,
        subscription_buffer: int = 1024,
        subscription_bytes: int = 16 << 20,
        subscriptions_bytes: int = 64 << 20,
        guest_niceness: int = 10,
        lanes: Sequence[Lanes] = (),
        max_matchers: int = 64,
        max_media: int = 64,
        tracing: Tracing | None = None,
        recording: RecordingLimits | None = None,
    ) -> None:
        """`lanes`: each model's fast path (those of `models`' views), opened to every
        instance. `tracing`: the engine's spans, when on (a span per launch). `recording`:
        record every instance's host calls into the log, within these limits."""
        super().__init__("inferlets", router, capacity=65536)
        self.lanes = tuple(lanes)
        self.core = core
        self.wasm = wasm
        self.models = models
        self.limits = limits
        self.version = version
        self._corr = corr
        self.files = InstanceFiles(files or FileLayout())
        self._subscription_buffer = subscription_buffer
        self._subscription_bytes = (subscription_bytes, subscriptions_bytes)
        self._guest_niceness = guest_niceness
        self._max_matchers = max_matchers
        self._max_media = max_media
        self.tracing = tracing
        self._linker = wasm.new_linker()
        add_inferlet_api(self._linker)
        self._recordings = InstanceRecordings(wasm, recording) if recording else None
        self._kills: dict[str, KillSwitch] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(super().run)
            nursery.start_soon(self.files.watch)
            task_status.started()

    async def handle(self, event: Any) -> None:
        self._emit_and_apply(self.core.handle(event))

    def _emit_and_apply(self, outputs: list[tuple[str, Any]]) -> None:
        assert self._nursery is not None
        if self.tracing is not None:  # before any instance's state asks for its launch's span
            _trace_launches(self.tracing, self.core, outputs)
        # An admitted instance's address takes deliveries before anything is sent to it: the
        # messages it queued, and those sent before its task runs, would otherwise be dropped.
        opened = [self._open(instance) for instance in self.core.to_start]
        self.core.to_start.clear()
        self.emit(outputs)
        for instance, state in opened:
            self._nursery.start_soon(self._run_instance, instance, state)
        for instance_id, reason in self.core.to_kill:
            kill_switch = self._kills.get(instance_id)
            if kill_switch is not None:
                kill_switch.kill(reason)
        self.core.to_kill.clear()

    def stop_all(self, reason: str) -> None:
        """Ends every queued and running instance (engine shutdown)."""
        self._emit_and_apply(self.core.stop_all(reason))

    def _open(self, instance: Instance) -> tuple[Instance, InstanceState]:
        """The state of an admitted instance, its address registered to take deliveries."""
        kill = KillSwitch()
        self._kills[instance.id] = kill
        bridge = TrioBridge(trio.lowlevel.current_trio_token(), self.router, instance.address)
        state = InstanceState(
            instance=instance.id,
            address=instance.address,
            user=instance.user,
            bridge=bridge,
            models=self.models,
            kill=kill,
            corr=self._corr,
            budget_seconds=self.limits.budget_seconds,
            version=self.version,
            subscription_buffer=self._subscription_buffer,
            subscription_bytes=self._subscription_bytes[0],
            subscriptions_bytes=self._subscription_bytes[1],
            max_matchers=self._max_matchers,
            max_media=self._max_media,
            trace=None if self.tracing is None else self.tracing.launch(instance.id),
        )
        bridge.state = state
        if instance.request is not None:
            state.response = serving.Response()
        for lanes in self.lanes:
            lanes.open_requester(instance.address)
        self.router.register_handler(instance.address, PROGRAM_INBOX, state.deliver)
        return instance, state

    async def _run_instance(self, instance: Instance, state: InstanceState) -> None:
        kill = state.kill
        finished = trio.Event()
        outcome: list[RunOutcome] = []

        def done(result: RunOutcome) -> None:
            outcome.append(result)
            finished.set()

        token = trio.lowlevel.current_trio_token()
        program = self.core.programs.resolve(instance.program.hash)
        limits = await self._limits_for(instance, kill)
        thread = threading.Thread(
            target=self._thread_main,
            args=(state, program, instance, limits, lambda r: token.run_sync_soon(done, r)),
            name=f"inferlet-{instance.id}",
            daemon=True,
        )
        thread.start()
        try:
            await finished.wait()
        finally:
            with trio.CancelScope(shield=True):
                if not finished.is_set():
                    kill.kill("the engine is stopping")
                    with trio.move_on_after(5):
                        await finished.wait()
                ended = await self._settle_files(instance, outcome[0] if outcome else None)
                self._clean_up(instance, ended)

    async def _limits_for(self, instance: Instance, kill: KillSwitch) -> SandboxLimits:
        if not self.files.layout.enabled:
            return self.limits
        try:
            with trio.CancelScope(shield=True):
                return await trio.to_thread.run_sync(
                    self.files.prepare, instance.id, instance.user, kill, self.limits
                )
        except (OSError, ValueError) as exc:
            kill.kill(f"the engine could not make the program's directories: {exc}", "failed")
        return self.limits

    async def _settle_files(
        self, instance: Instance, outcome: RunOutcome | None
    ) -> RunOutcome | None:
        if not self.files.layout.enabled:
            return outcome
        return await trio.to_thread.run_sync(self.files.finish, instance.id, outcome)

    def _thread_main(
        self,
        state: InstanceState,
        program: Program,
        instance: Instance,
        limits: SandboxLimits,
        done: Any,
    ) -> None:
        with contextlib.suppress(OSError, AttributeError):
            # Guest threads yield to the driver thread, so a busy guest never delays a pass.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._guest_niceness)
        bind(state)
        recorder = self._recordings.recorder(state) if self._recordings else None
        bind_recorder(recorder)
        if recorder is not None:
            state.while_idle = (IDLE_SECONDS, recorder.encode_pending)
        started = time.monotonic()
        try:
            outcome = self._execute(state, program, instance, limits)
        except BaseException as exc:  # the host must learn of every end, whatever happened
            outcome = RunOutcome(
                status="trapped",
                value=None,
                error=f"{type(exc).__name__}: {exc}",
                seconds=time.monotonic() - started,
            )
        finally:
            bind(None)
            bind_recorder(None)
            if recorder is not None:
                recorder.close()
            state.runs.cancel_all()
            state.grammar.close_all()
            release_media(state)
            release_speech(state)
        try:
            done(outcome)
        except trio.RunFinishedError:
            pass

    def _execute(
        self, state: InstanceState, program: Program, instance: Instance, limits: SandboxLimits
    ) -> RunOutcome:
        try:
            _, component = self.wasm.cache.load(program.wasm, program.info.hash)
        except InvalidProgram as exc:
            return RunOutcome(status="failed", value=None, error=str(exc), seconds=0.0)

        def on_output(stream: str, data: bytes) -> None:
            text = data.decode("utf-8", errors="replace")
            with contextlib.suppress(GuestStopped):
                state.bridge.post(
                    "inferlets",
                    ev.InferletOutput(instance=state.instance, stream=stream, text=text),
                )

        request = instance.request
        recordings = self._recordings
        outcome = self.wasm.run(
            component,
            recordings.linker_for(component) if recordings else self._linker,
            instance.input,
            limits=limits,
            kill=state.kill,
            on_output=on_output,
            request=None if request is None else request_record(request),
        )
        if request is None or not outcome.returned:
            return outcome
        try:
            serving.finish(state, outcome.value)
        except HostFailure as failure:
            return RunOutcome(status="failed", error=failure.message, seconds=outcome.seconds)
        return RunOutcome(status="returned", value="", seconds=outcome.seconds)

    def _clean_up(self, instance: Instance, outcome: RunOutcome | None) -> None:
        self._kills.pop(instance.id, None)
        self.router.unregister(instance.address)
        src = instance.address
        for lanes in self.lanes:
            lanes.close_requester(src)
        for model in self.models:
            release = kv_ev.ReleaseRequester(corr=next(self._corr), requester=src, reply=False)
            self.router.send_nowait(src, model.kv, release)
        self.router.send_nowait(src, "bus", bus_ev.LeaveBus(corr=next(self._corr), requester=src))
        if outcome is None:
            outcome = RunOutcome(
                status="killed", value=None, error="the engine stopped", seconds=0.0
            )
        finished = ev.InferletFinished(
            instance=instance.id,
            status=outcome.status,
            result=outcome.value,
            error=outcome.error,
            seconds=outcome.seconds,
        )
        self.router.send_nowait(self.address, self.address, finished)

    def statistics(self) -> InferletStatistics:
        return self.core.statistics()


def _trace_launches(tracing: Tracing, core: InferletCore, outputs: list[tuple[str, Any]]) -> None:
    """Starts the span of each launch accepted and ends that of each instance ended."""
    for _, event in outputs:
        if isinstance(event, ev.InferletLaunched):
            instance = core.instances[event.instance]
            tracing.launched(
                instance.id,
                address=instance.address,
                launcher=instance.launcher,
                corr=event.corr,
                program=instance.program.hash,
                user=instance.user,
            )
        elif isinstance(event, ev.InferletEnd):
            outcome = ev.outcome_of(event)
            tracing.ended(event.instance, outcome.status, outcome.error)


def request_record(request: ev.IncomingRequest) -> Any:
    """The `incoming-request` record an HTTP-served program's `handle` takes."""
    return record(
        method=request.method,
        path=request.path,
        query=request.query,
        headers=[record(name=k, value=v) for k, v in request.headers],
        body=request.body,
    )
