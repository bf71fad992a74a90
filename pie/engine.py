"""Wiring: one nursery, the actors connected through the router, start order, graceful stop."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import trio
from attrs import frozen

from pie import __version__
from pie.actors.bus import BusCore, BusLimits, BusStatistics
from pie.actors.http import HttpActor, HttpStatistics
from pie.actors.inference import InferenceActor, InferenceStatistics
from pie.actors.inferlet import InferletActor, InferletCore, InferletStatistics, ProgramRegistry
from pie.actors.inferlet.core import AdmissionLimits
from pie.actors.inferlet.files import FileLayout, Quota
from pie.actors.kv import KvCore, KvStatistics, OutputLimits, Quotas
from pie.actors.kv.actor import KvActor
from pie.actors.kv.durable import SnapshotStore
from pie.actors.mcp import McpActor, McpStatistics
from pie.actors.requester import InferletOutcome, Requester, correlation_ids
from pie.actors.runtime import CoreActor, MailboxStatistics, Router
from pie.config import (
    EngineConfig,
    GrammarConfig,
    NetworkConfig,
    SandboxConfig,
    default_cache_dir,
    with_overrides,
)
from pie.dataplane import (
    BatchFormer,
    BatchPolicy,
    BatchStatistics,
    Lanes,
    SpeculationStatistics,
)
from pie.drivers.base import Driver, DriverInfo
from pie.drivers.memory import MemoryUse, memory_use
from pie.eventlog import EventLog
from pie.events.batching import EngineStarted
from pie.grammar import GrammarLimits, Grammars
from pie.net.fetch import Fetcher, Limits
from pie.net.policy import NetworkPolicy
from pie.net.quota import FetchQuota
from pie.sandbox import SandboxLimits, WasmRuntime
from pie.sandbox.host import ModelView


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


class Engine:
    """A running engine. Use `open_engine`; talk to it through `requester()`."""

    def __init__(
        self,
        config: EngineConfig,
        driver: Driver,
        tokenizer: Any,
        nursery: trio.Nursery,
    ) -> None:
        self.config = config
        self.driver = driver
        self.tokenizer = tokenizer
        self.info: DriverInfo = driver.info
        log_config = config.event_log
        self.log = (
            EventLog(
                ring_size=log_config.ring_size,
                path=log_config.path or None,
                max_unwritten=log_config.max_unwritten,
                ring_payload=log_config.ring_payload_chars,
            )
            if log_config.enabled
            else None
        )
        self.router = Router(self.log)
        self._nursery = nursery
        self._corr = correlation_ids()
        self._names = itertools.count(1)
        policy = BatchPolicy(
            max_batch_tokens=min(config.scheduler.max_batch_tokens, self.info.max_batch_tokens),
            max_batch_requests=min(
                config.scheduler.max_batch_requests, self.info.max_batch_requests
            ),
            decode_tokens=config.scheduler.decode_tokens,
        )
        self.kv = KvActor(
            KvCore(
                num_pages=self.info.num_pages,
                page_size=self.info.page_size,
                vocab_size=self.info.vocab_size,
                prefix_cache=config.kv.prefix_cache,
                sliding_window=self.info.sliding_window,
                adapters=self.info.adapters,
                quotas=_quotas(config, self.info.num_pages),
                outputs=OutputLimits(
                    max_slots=config.scheduler.max_slots_per_pass,
                    max_values=config.scheduler.max_probe_values,
                ),
            ),
            self.router,
            SnapshotStore(Path(config.kv.snapshots_dir)) if config.kv.snapshots_dir else None,
        )
        self.policy = policy
        depth = config.scheduler.speculation_depth
        self.lanes = Lanes(
            page_size=self.info.page_size,
            vocab_size=self.info.vocab_size,
            depth=depth,
            post=lambda events: self.inference.post(events),
        )
        self.inference = InferenceActor(driver, self.router, self.lanes, BatchFormer(policy))
        self.bus = CoreActor(BusCore(BusLimits.from_config(config.bus)), "bus", self.router)
        self.http = HttpActor(_fetcher(config.network), self.router, _fetch_quota(config.network))
        self.mcp = McpActor(config.mcp, self.router)
        self.programs = ProgramRegistry()
        self.wasm = WasmRuntime(
            Path(config.sandbox.cache_dir or default_cache_dir() / "components"),
            epoch_interval=config.sandbox.epoch_ms / 1000,
        )
        self.inferlets = self._inferlet_actor(policy.max_batch_tokens)

    def _inferlet_actor(self, max_batch_tokens: int) -> InferletActor:
        sandbox = self.config.sandbox
        model = ModelView(
            name=self.info.model_name,
            tokenizer=self.tokenizer,
            vocab_size=self.info.vocab_size,
            page_size=self.info.page_size,
            max_batch_tokens=max_batch_tokens,
            grammars=_grammars(self.config.grammar, self.tokenizer, self.info.vocab_size),
            adapters=self.info.adapters,
        )
        return InferletActor(
            InferletCore(self.programs, _admission_limits(sandbox)),
            self.router,
            wasm=self.wasm,
            models=[model],
            limits=SandboxLimits(
                budget_seconds=sandbox.budget_seconds, memory_bytes=sandbox.memory_mb << 20
            ),
            corr=self._corr,
            version=__version__,
            files=_file_layout(sandbox),
            subscription_buffer=sandbox.subscription_buffer,
            subscription_bytes=sandbox.subscription_buffer_mb << 20,
            subscriptions_bytes=sandbox.subscription_buffer_inferlet_mb << 20,
            guest_niceness=sandbox.guest_niceness,
            lanes=self.lanes if self.config.scheduler.fast_path else None,
            max_matchers=self.config.grammar.max_matchers_per_inferlet,
        )

    async def _start(self) -> None:
        if self.log is not None:
            started = EngineStarted(
                model=self.info.model_name,
                vocab_size=self.info.vocab_size,
                page_size=self.info.page_size,
                num_pages=self.info.num_pages,
                max_batch_tokens=self.policy.max_batch_tokens,
                max_batch_requests=self.policy.max_batch_requests,
                prefix_cache=self.config.kv.prefix_cache,
                sliding_window=self.info.sliding_window,
                adapters=self.info.adapters,
            )
            self.log.append("engine", "engine", started)
        self.wasm.start()
        actors = (
            self.inference,
            self.kv,
            self.bus,
            self.http,
            self.mcp,
        )
        for actor in (*actors, self.inferlets):
            await self._nursery.start(actor.run)
        if self.kv.store is not None:
            async with self.requester("kv:recovery") as requester:
                await self.kv.recover(requester)

    @contextlib.asynccontextmanager
    async def requester(self, name: str | None = None) -> AsyncIterator[Requester]:
        """A new address that owns the contexts it creates; they are destroyed when it closes."""
        address = name or f"client:{next(self._names)}"
        requester = Requester(self.router, address, self._corr)
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
            memory=memory_use(self.driver),
        )

    async def _drain(self, timeout: float) -> None:
        """Stops inferlets, then lets passes already placed finish, so no completed work is
        lost."""
        with trio.move_on_after(timeout, shield=True):
            self.inferlets.stop_all("the engine is stopping")
            while self.inferlets.core.instances or self.kv.core.in_flight or self.kv.core.leases:
                await trio.sleep(0.01)

    def _close(self) -> None:
        self.wasm.close()
        self.router.close()
        if self.log is not None:
            self.log.close()


@contextlib.asynccontextmanager
async def open_engine(
    config: EngineConfig | None = None,
    *,
    driver: Driver | None = None,
    tokenizer: Any = None,
    drain_seconds: float = 30.0,
) -> AsyncIterator[Engine]:
    """Starts every actor in one nursery and stops them gracefully on exit.

    Without `driver`, the configured model is loaded (off the Trio thread) into a torch driver.
    """
    config = config or EngineConfig()
    if driver is None:
        from pie.drivers.threads import set_wait_policy

        set_wait_policy(config.driver)  # before the factory's imports load torch
        from pie.drivers.factory import build_driver

        built, tokenizer = await trio.to_thread.run_sync(build_driver, config)
        driver = built
    async with trio.open_nursery() as nursery:
        engine = Engine(config, driver, tokenizer, nursery)
        await engine._start()
        try:
            yield engine
        finally:
            await engine._drain(drain_seconds)
            engine._close()
            nursery.cancel_scope.cancel()


def with_snapshots_dir(config: EngineConfig) -> EngineConfig:
    """`config` keeping named snapshots on disk: an empty [kv] snapshots_dir becomes
    `snapshots` beside the compiled components, as `pie serve` runs."""
    if config.kv.snapshots_dir:
        return config
    components = Path(config.sandbox.cache_dir or default_cache_dir() / "components")
    return with_overrides(config, kv={"snapshots_dir": str(components.parent / "snapshots")})


def _quotas(config: EngineConfig, num_pages: int) -> Quotas:
    kv = config.kv
    return Quotas.shares(
        num_pages,
        inferlet=kv.inferlet_page_share,
        user=kv.user_page_share,
        snapshots=kv.snapshot_page_share,
    )


def _grammars(config: GrammarConfig, tokenizer: Any, vocab_size: int) -> Grammars | None:
    """The model's grammar engine; none for an engine without a real tokenizer."""
    if not hasattr(tokenizer, "backend_json"):
        return None
    limits = GrammarLimits(
        max_source_bytes=config.max_source_kb << 10,
        cache_entries=config.cache_entries,
        max_matchers_per_user=config.max_matchers_per_user,
    )
    return Grammars(tokenizer.backend_json, vocab_size, sorted(tokenizer.stop_token_ids), limits)


def _fetch_quota(config: NetworkConfig) -> FetchQuota:
    return FetchQuota(
        per_inferlet=config.max_fetches_per_inferlet, per_user=config.max_fetches_per_user
    )


def _fetcher(config: NetworkConfig) -> Fetcher:
    limits = Limits(
        timeout_seconds=config.timeout_seconds,
        max_response_bytes=int(config.max_response_mb * (1 << 20)),
        max_redirects=config.max_redirects,
    )
    policy = NetworkPolicy.parse(config.allow, config.deny)
    return Fetcher(policy, limits, max_connections=config.max_connections)


def _admission_limits(sandbox: SandboxConfig) -> AdmissionLimits:
    return AdmissionLimits(
        max_concurrent=sandbox.max_concurrent,
        max_per_user=sandbox.max_inferlets_per_user,
        max_running_per_user=sandbox.max_running_per_user,
        max_children=sandbox.max_children,
        max_depth=sandbox.max_child_depth,
        memory_cap=sandbox.memory_mb << 20,
        memory_budget=sandbox.guest_memory_bytes,
    )


def _file_layout(config: SandboxConfig) -> FileLayout:
    return FileLayout(
        scratch_root=config.scratch_dir,
        scratch_quota=Quota(
            max_bytes=config.scratch_quota_mb * (1 << 20), max_files=config.scratch_max_files
        ),
        persist_root=config.persist_dir,
        persist_quota=Quota(
            max_bytes=config.persist_quota_mb * (1 << 20), max_files=config.persist_max_files
        ),
        check_seconds=config.files_check_ms / 1000,
    )
