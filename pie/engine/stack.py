"""One served model's part of the engine: its driver, the kv actor over its pages, its fast path
and the inference actor that runs its passes. An engine serving several models holds a stack
for each; the first answers at the plain addresses `kv` and `inference`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from attrs import frozen

from pie.actors.inference import InferenceActor
from pie.actors.kv import KvCore, OutputLimits, Quotas
from pie.actors.kv.actor import KvActor
from pie.actors.kv.durable import SnapshotStore
from pie.actors.runtime import Router
from pie.config import EngineConfig
from pie.dataplane import BatchFormer, BatchPolicy, Lanes, Speaker, SpeechDesk
from pie.dataplane.tape import RecordingFormer
from pie.drivers.base import Driver, DriverInfo, PageTransfer, page_transfer
from pie.events.batching import EngineStarted, FormerStep, FormerSteps

Elsewhere = Callable[[tuple[str, str]], str | None]


@frozen(kw_only=True, eq=False)
class ModelStack:
    index: int
    driver: Driver
    tokenizer: Any
    policy: BatchPolicy
    kv: KvActor
    lanes: Lanes
    inference: InferenceActor
    speech: SpeechDesk | None = None
    """The model's speech requests, for a model that speaks."""

    @property
    def info(self) -> DriverInfo:
        return self.driver.info

    @property
    def name(self) -> str:
        return self.driver.info.model_name

    @property
    def kv_address(self) -> str:
        return self.kv.address

    def page_transfer(self) -> PageTransfer | None:
        """The driver's whole-page KV reads and writes (None: it has none)."""
        return page_transfer(self.driver)

    def started(self, config: EngineConfig, count: int) -> EngineStarted:
        """The log's record of what this model's kv core and batch former were built with
        (`count`: the models the engine serves)."""
        return EngineStarted(
            model=self.name,
            vocab_size=self.info.vocab_size,
            page_size=self.info.page_size,
            num_pages=self.info.num_pages,
            max_batch_tokens=self.policy.max_batch_tokens,
            max_batch_requests=self.policy.max_batch_requests,
            prefix_cache=config.kv.prefix_cache,
            sliding_window=self.info.sliding_window,
            adapters=self.info.adapters,
            index=self.index,
            count=count,
            directory=self.kv.core.directory,
        )


def directory_address(kv_address: str) -> str:
    """Where a clustered node's kv actor at `kv_address` hands snapshots it lacks."""
    return f"{kv_address}.directory"


def addresses(index: int, name: str) -> tuple[str, str]:
    """(kv, inference) actor addresses of the model at `index` named `name`."""
    return ("kv", "inference") if index == 0 else (f"kv:{name}", f"inference:{name}")


def build_stack(
    config: EngineConfig,
    driver: Driver,
    tokenizer: Any,
    router: Router,
    *,
    index: int,
    count: int,
    elsewhere: Elsewhere | None,
) -> ModelStack:
    """The actors of the model at `index` of `count` (not started)."""
    info = driver.info
    kv_address, inference_address = addresses(index, info.model_name)
    scheduler = config.scheduler
    policy = BatchPolicy(
        max_batch_tokens=min(scheduler.max_batch_tokens, info.max_batch_tokens),
        max_batch_requests=min(scheduler.max_batch_requests, info.max_batch_requests),
        decode_tokens=scheduler.decode_tokens,
    )
    directory = directory_address(kv_address) if config.cluster.redis else None
    core = kv_core(config, info, index=index, count=count, elsewhere=elsewhere, directory=directory)
    store = _store(config, index, info.model_name)
    media = getattr(driver, "media", None)
    kv = KvActor(core, router, store, address=kv_address, media=media)
    inference: list[InferenceActor] = []
    lanes = Lanes(
        page_size=info.page_size,
        vocab_size=info.vocab_size,
        depth=scheduler.speculation_depth,
        post=lambda events: inference[0].post(events),
        address=kv_address,
        chain=_chains(scheduler.chain_passes, driver),
    )
    speech = _speech_desk(driver, lanes)
    former = _former(router, policy, inference_address, info.model_name, inference)
    inference.append(
        InferenceActor(
            driver,
            router,
            lanes,
            former,
            kv=kv_address,
            address=inference_address,
            speech=speech,
        )
    )
    return ModelStack(
        index=index,
        driver=driver,
        tokenizer=tokenizer,
        policy=policy,
        kv=kv,
        lanes=lanes,
        inference=inference[0],
        speech=speech,
    )


def _speech_desk(driver: Driver, lanes: Lanes) -> SpeechDesk | None:
    """The desk of a driver whose model speaks; it steps on the pass loop's condition."""
    if "speech" not in driver.info.outputs:
        return None
    speaker: Speaker = getattr(driver, "model")  # noqa: B009  (a torch driver's model)
    return SpeechDesk(speaker, lanes.cond)


def _store(config: EngineConfig, index: int, name: str) -> SnapshotStore | None:
    """Where the model's named snapshots are kept: [kv] snapshots_dir for the first model, and
    beside it `<snapshots_dir>.<name>` for each other one."""
    if not config.kv.snapshots_dir:
        return None
    root = Path(config.kv.snapshots_dir)
    return SnapshotStore(root if index == 0 else Path(f"{root}.{quote(name, safe='')}"))


def kv_core(
    config: EngineConfig,
    info: Any,
    *,
    index: int,
    count: int,
    elsewhere: Elsewhere | None = None,
    directory: str | None = None,
) -> KvCore:
    """The kv core of the model at `index` of `count`; `info` has the driver's figures
    (model_name, num_pages, page_size, vocab_size, sliding_window, adapters)."""
    scheduler = config.scheduler
    return KvCore(
        num_pages=info.num_pages,
        page_size=info.page_size,
        vocab_size=info.vocab_size,
        data_plane=addresses(index, info.model_name)[1],
        prefix_cache=config.kv.prefix_cache,
        sliding_window=info.sliding_window,
        adapters=info.adapters,
        quotas=_quotas(config, info.num_pages),
        outputs=OutputLimits(
            max_slots=scheduler.max_slots_per_pass, max_values=scheduler.max_probe_values
        ),
        context_ids=(index + 1, count),
        model=info.model_name,
        elsewhere=elsewhere,
        directory=directory,
    )


def former_address(inference_address: str) -> str:
    """Where a model's batch former records its steps in the event log."""
    return f"{inference_address}.former"


def _former(
    router: Router, policy: BatchPolicy, inference_address: str, model: str, inference: list[Any]
) -> BatchFormer:
    """A former that records its steps into the event log when there is one."""
    if router.log is None:
        return BatchFormer(policy)
    address = former_address(inference_address)
    router.register_handler(address, FormerSteps, lambda _: None)

    def sink(steps: tuple[FormerStep, ...]) -> None:
        inference[0].post([(address, FormerSteps(model=model, steps=steps))])

    return RecordingFormer(policy, sink)


def _quotas(config: EngineConfig, num_pages: int) -> Quotas:
    kv = config.kv
    return Quotas.shares(
        num_pages,
        inferlet=kv.inferlet_page_share,
        user=kv.user_page_share,
        snapshots=kv.snapshot_page_share,
    )


def _chains(setting: str, driver: Driver) -> bool:
    """Whether the fast path chains passes on the device: `[scheduler] chain_passes`, where
    auto means a driver that launches passes on a CUDA device."""
    if setting == "auto":
        return hasattr(driver, "launch") and driver.info.device.startswith("cuda")
    return setting == "on" and hasattr(driver, "launch")
