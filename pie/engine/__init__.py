"""Wiring: one nursery, the actors connected through the router, start order, graceful stop."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import trio
from attrs import frozen

from pie import __version__
from pie.actors.bus import BusCore, BusLimits, BusStatistics
from pie.actors.http import HttpActor, HttpStatistics
from pie.actors.inference import InferenceStatistics
from pie.actors.inferlet import InferletActor, InferletCore, InferletStatistics, ProgramRegistry
from pie.actors.inferlet.recording import recording_limits
from pie.actors.kv import KvStatistics
from pie.actors.mcp import McpActor, McpStatistics
from pie.actors.requester import InferletOutcome, Requester, correlation_ids
from pie.actors.runtime import Actor, CoreActor, MailboxStatistics, Router
from pie.config import (
    EngineConfig,
    default_cache_dir,
    with_overrides,
)
from pie.dataplane import BatchStatistics, SpeculationStatistics
from pie.drivers.base import Driver, DriverInfo
from pie.drivers.memory import MemoryUse, memory_use
from pie.engine.parts import (
    admission_limits,
    engine_tracing,
    fetch_quota,
    fetcher,
    file_layout,
    grammars,
    locked_encode,
)
from pie.engine.records import record_start
from pie.engine.stack import ModelStack, build_stack
from pie.eventlog import EventLog
from pie.sandbox import SandboxLimits, WasmRuntime
from pie.sandbox.host import ModelView
from pie.sandbox.host.records import SpeechHolds, SpeechLimits


@frozen(kw_only=True)
class ModelStatistics:
    """One served model's figures (EngineStatistics' kv, scheduler and inference are the
    default model's)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kv: KvStatistics
    scheduler: BatchStatistics
    inference: InferenceStatistics


@frozen(kw_only=True)
class EngineStatistics:
    kv: KvStatistics
    scheduler: BatchStatistics
    inference: InferenceStatistics
    speculation: SpeculationStatistics
    bus: BusStatistics
    http: HttpStatistics
    mcp: McpStatistics
    inferlets: InferletStatistics
    mailboxes: tuple[MailboxStatistics, ...]
    logged_events: int
    memory: MemoryUse
    models: tuple[ModelStatistics, ...] = ()


class Engine:
    """A running engine. Use `open_engine`; talk to it through `requester()`.

    It serves one model per (driver, tokenizer) in `served`, the first the default: `driver`,
    `info`, `kv`, `lanes` and `inference` are the default model's, `models` has them all."""

    def __init__(
        self,
        config: EngineConfig,
        served: Sequence[tuple[Driver, Any]],
        nursery: trio.Nursery,
        bus: Callable[[Router], Actor] | None = None,
    ) -> None:
        if not served:
            raise ValueError("an engine serves at least one model")
        self.config = config
        log_config = config.event_log
        self.log = (
            EventLog(
                ring_size=log_config.ring_size,
                path=log_config.path or None,
                max_unwritten=log_config.max_unwritten,
                ring_payload=log_config.ring_payload_chars,
                encoder=log_config.encoder,
            )
            if log_config.enabled
            else None
        )
        self.router = Router(self.log)
        self.tracing = engine_tracing(config)
        """The engine's OpenTelemetry spans ([tracing]); None when off."""
        self._nursery = nursery
        self._corr = correlation_ids()
        self._names = itertools.count(1)
        names = [driver.info.model_name for driver, _ in served]
        if len(set(names)) < len(names):
            raise ValueError(f"the served models need distinct names, got {names}")
        elsewhere = self._snapshot_holder if len(served) > 1 else None
        self.models = [
            build_stack(
                config,
                driver,
                tokenizer,
                self.router,
                index=i,
                count=len(served),
                elsewhere=elsewhere,
            )
            for i, (driver, tokenizer) in enumerate(served)
        ]
        default = self.models[0]
        self.driver = default.driver
        self.tokenizer = default.tokenizer
        self.info: DriverInfo = default.info
        self.kv = default.kv
        self.lanes = default.lanes
        self.inference = default.inference
        self.policy = default.policy
        if self.tracing is not None:
            for stack in self.models:
                stack.inference.observe_passes(self.tracing.record_pass(stack.name))
        # A clustered node brings its own bus (pie/cluster/bus.py); the local one is a pure core.
        self.bus: Any = (
            bus(self.router)
            if bus is not None
            else CoreActor(BusCore(BusLimits.from_config(config.bus)), "bus", self.router)
        )
        self.http = HttpActor(
            fetcher(config.network, self.tracing), self.router, fetch_quota(config.network)
        )
        self.mcp = McpActor(config.mcp, self.router, tracing=self.tracing)
        self.programs = ProgramRegistry()
        self.wasm = WasmRuntime(
            Path(config.sandbox.cache_dir or default_cache_dir() / "components"),
            epoch_interval=config.sandbox.epoch_ms / 1000,
        )
        media = config.media
        self.speech_holds = SpeechHolds(
            SpeechLimits(
                max_seconds=media.speech_max_seconds,
                per_inferlet=media.max_speech_per_inferlet,
                per_user=media.max_speech_per_user,
            )
        )
        self.inferlets = self._inferlet_actor()

    def model(self, name: str | None = None) -> ModelStack:
        """The served model called `name` (None or "default": the first); KeyError otherwise."""
        if name in (None, "", "default"):
            return self.models[0]
        for stack in self.models:
            if stack.name == name:
                return stack
        raise KeyError(f"no model {name!r}; the engine serves {[m.name for m in self.models]}")

    def _snapshot_holder(self, key: tuple[str, str]) -> str | None:
        """The model whose kv core holds the named snapshot `key` (user, name), if any."""
        return next((m.name for m in self.models if key in m.kv.core.snapshots), None)

    def _view(self, stack: ModelStack) -> ModelView:
        fast = self.config.scheduler.fast_path
        store = getattr(stack.driver, "media", None)
        view = ModelView(
            name=stack.name,
            tokenizer=stack.tokenizer,
            vocab_size=stack.info.vocab_size,
            page_size=stack.info.page_size,
            max_batch_tokens=stack.policy.max_batch_tokens,
            grammars=grammars(self.config.grammar, stack.tokenizer, stack.info.vocab_size),
            adapters=stack.info.adapters,
            kv=stack.kv_address,
            lanes=stack.lanes if fast else None,
            inputs=stack.info.inputs,
            outputs=stack.info.outputs,
            media=store,
            speech=stack.speech,
            speech_holds=self.speech_holds if stack.speech is not None else None,
        )
        if store is not None:
            store.tokenize = locked_encode(view)
        return view

    def _inferlet_actor(self) -> InferletActor:
        sandbox = self.config.sandbox
        return InferletActor(
            InferletCore(self.programs, admission_limits(sandbox)),
            self.router,
            wasm=self.wasm,
            models=[self._view(stack) for stack in self.models],
            limits=SandboxLimits(
                budget_seconds=sandbox.budget_seconds, memory_bytes=sandbox.memory_mb << 20
            ),
            corr=self._corr,
            version=__version__,
            files=file_layout(sandbox),
            subscription_buffer=sandbox.subscription_buffer,
            subscription_bytes=sandbox.subscription_buffer_mb << 20,
            subscriptions_bytes=sandbox.subscription_buffer_inferlet_mb << 20,
            guest_niceness=sandbox.guest_niceness,
            lanes=[m.lanes for m in self.models] if self.config.scheduler.fast_path else [],
            max_matchers=self.config.grammar.max_matchers_per_inferlet,
            max_media=self.config.media.max_items_per_inferlet,
            tracing=self.tracing,
            recording=recording_limits(self.config.event_log),
        )

    async def _start(self) -> None:
        if self.log is not None:
            count = len(self.models)
            record_start(
                self.log,
                [stack.started(self.config, count) for stack in self.models],
                self.config,
                self.inferlets.core.limits,
                self.programs,
            )
        self.wasm.start()
        stacks = [actor for m in self.models for actor in (m.inference, m.kv)]
        for actor in (*stacks, self.bus, self.http, self.mcp, self.inferlets):
            await self._nursery.start(actor.run)
        for stack in self.models:
            if stack.kv.store is not None:
                async with self.requester(f"recovery:{stack.name}", model=stack.name) as req:
                    await stack.kv.recover(req)

    @contextlib.asynccontextmanager
    async def requester(
        self, name: str | None = None, *, model: str | None = None
    ) -> AsyncIterator[Requester]:
        """A new address that owns the contexts it creates (on `model`, None: the default);
        they are destroyed when it closes."""
        address = name or f"client:{next(self._names)}"
        kv = self.model(model).kv_address
        requester = Requester(self.router, address, self._corr, kv=kv)
        await self._nursery.start(requester.run)
        try:
            yield requester
        finally:
            await requester.close()

    async def run_inferlet(
        self,
        program: str,
        input: str,
        *,
        user: str = "local",
        on_event: Callable[[Any], None] | None = None,
    ) -> InferletOutcome:
        """Runs a program added to `programs` (by hash, name or name@version) to its end.

        `on_event` receives its InferletStarted, InferletOutput and SessionMessage events.
        """
        async with self.requester() as requester:
            run = await requester.launch(program, input, user=user)
            return await run.outcome(on_event)

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            kv=self.kv.statistics(),
            scheduler=self.inference.batch_statistics(),
            inference=self.inference.statistics(),
            speculation=self.lanes.statistics(),
            bus=self.bus.statistics(),
            http=self.http.statistics(),
            mcp=self.mcp.statistics(),
            inferlets=self.inferlets.statistics(),
            mailboxes=tuple(self.router.statistics()),
            logged_events=len(self.log) if self.log is not None else 0,
            memory=memory_use(*(m.driver for m in self.models)),
            models=tuple(_model_statistics(m) for m in self.models),
        )

    async def _drain(self, timeout: float) -> None:
        """Stops inferlets, then lets passes already placed finish, so no completed work is
        lost."""
        with trio.move_on_after(timeout, shield=True):
            self.inferlets.stop_all("the engine is stopping")
            while self.inferlets.core.instances or any(
                m.kv.core.in_flight or m.kv.core.leases for m in self.models
            ):
                await trio.sleep(0.01)

    def _close(self) -> None:
        self.wasm.close()
        for stack in self.models:
            stack.inference.flush_former()
        self.router.close()
        if self.log is not None:
            self.log.close()
        if self.tracing is not None:
            self.tracing.shutdown()


@contextlib.asynccontextmanager
async def open_engine(
    config: EngineConfig | None = None,
    *,
    driver: Driver | None = None,
    tokenizer: Any = None,
    served: Sequence[tuple[Driver, Any]] = (),
    drain_seconds: float = 30.0,
    bus: Callable[[Router], Actor] | None = None,
) -> AsyncIterator[Engine]:
    """Starts every actor in one nursery and stops them gracefully on exit.

    Without `driver`, the configured models ([model] or [[models]]) are loaded (off the Trio
    thread), each into the driver `[driver] backend` picks; `served` gives several (driver,
    tokenizer) pairs instead, the first the default model. `bus` builds the actor at `bus`
    in place of the local bus (a clustered node's).
    """
    config = config or EngineConfig()
    if served:
        served = list(served)
    elif driver is not None:
        served = [(driver, tokenizer)]
    built = not served and driver is None
    if built:
        from pie.drivers.threads import set_wait_policy

        set_wait_policy(config.driver)  # before the factory's imports load torch
        from pie.drivers.factory import build_drivers

        served = await trio.to_thread.run_sync(build_drivers, config)
    try:
        async with trio.open_nursery() as nursery:
            engine = Engine(config, served, nursery, bus)
            await engine._start()
            try:
                yield engine
            finally:
                await engine._drain(drain_seconds)
                engine._close()
                nursery.cancel_scope.cancel()
    finally:
        if built:
            _close_drivers(served)


def _close_drivers(served: Sequence[tuple[Driver, Any]]) -> None:
    """Stops what the engine's own drivers hold outside this process (tensor-parallel ranks)."""
    for driver, _ in served:
        close = getattr(driver, "close", None)
        if close is not None:
            close()


def with_snapshots_dir(config: EngineConfig) -> EngineConfig:
    """`config` keeping named snapshots on disk: an empty [kv] snapshots_dir becomes
    `snapshots` beside the compiled components, as `pie serve` runs."""
    if config.kv.snapshots_dir:
        return config
    components = Path(config.sandbox.cache_dir or default_cache_dir() / "components")
    return with_overrides(config, kv={"snapshots_dir": str(components.parent / "snapshots")})


def _model_statistics(stack: ModelStack) -> ModelStatistics:
    return ModelStatistics(
        name=stack.name,
        inputs=stack.info.inputs,
        outputs=stack.info.outputs,
        kv=stack.kv.statistics(),
        scheduler=stack.inference.batch_statistics(),
        inference=stack.inference.statistics(),
    )
