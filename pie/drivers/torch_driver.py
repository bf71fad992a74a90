"""The plain-torch driver (CPU, or any torch device): checks a batch, applies page copies,
runs the model with paged attention, and reads every sampling slot out of the logits."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from attrs import frozen

from pie.drivers.attention import PagedAttention, rle_rows
from pie.drivers.base import DriverError, DriverInfo
from pie.drivers.batch import ForwardBatch
from pie.drivers.batch_checks import validate_batch
from pie.drivers.cpu_layers import cpu_layer_kernels
from pie.drivers.decode_attention import reads_in_place
from pie.drivers.host_copies import device_tensor, to_device
from pie.drivers.kvcache import KvCacheShape, PagedKvCache, pages_for_budget
from pie.drivers.kvcache_int8 import Int8PagedKvCache
from pie.drivers.lora import LoraAdapters
from pie.drivers.media_store import MediaRefused, MediaStore
from pie.drivers.memory import model_bytes
from pie.drivers.models.base import CausalLM, LayerAttention, ModelConfig
from pie.drivers.models.media import MediaRows
from pie.drivers.page_transfer import CachePages
from pie.drivers.sampling import SlotReadout, launch_slots
from pie.events.sampling import LogitBias, Penalty, SlotOutput


@frozen(kw_only=True)
class DriverStatistics:
    """Completed passes so far (refused batches do not count) and their wall time."""

    passes: int
    tokens: int
    last_pass_seconds: float
    total_seconds: float


Chained = tuple[torch.Tensor, torch.Tensor]
"""A pass's chained tokens on the device: (flat token indices, the tokens to write there)."""


@frozen
class LaunchedPass:
    """A pass queued on the device: its slots' readout (None: no slot), when `launch` began,
    and its token count."""

    readout: SlotReadout | None
    started: float
    tokens: int


class TorchDriver:
    """A Driver over any CausalLM on one torch device.

    The model must already live on `device`; `dtype` is the KV cache's element type; `seed`
    seeds the generator of sampler slots that bring no seed of their own. Every pass runs
    under inference_mode, and a batch is fully validated (and its masks built) before the
    first KV page is touched. `adapters`: LoRA adapters already applied to the model, which a
    request may name. A float32 model on the CPU runs its norms and rotary embedding on pie's
    compiled layer kernels (cpu_layers).
    """

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        *,
        page_size: int,
        num_pages: int,
        max_batch_tokens: int,
        max_batch_requests: int,
        device: str,
        dtype: torch.dtype,
        model_name: str,
        seed: int | None = None,
        adapters: LoraAdapters | None = None,
        kv_dtype: torch.dtype | None = None,
        media: MediaStore | None = None,
    ) -> None:
        self.model = model
        self.dtype = dtype
        self.media = media
        """The model's media and their encoder outputs, for a model with media towers."""
        if device == "cpu" and dtype == torch.float32:
            model.use_kernels(cpu_layer_kernels())
        self.adapters = adapters
        self.attention_layers = model.attention_layers()
        self._model_bytes: int | None = None
        self.info = DriverInfo(
            model_name=model_name,
            vocab_size=config.vocab_size,
            page_size=page_size,
            num_pages=num_pages,
            max_batch_tokens=max_batch_tokens,
            max_batch_requests=max_batch_requests,
            device=device,
            dtype=str(dtype).removeprefix("torch."),
            threads=torch.get_num_threads(),
            sliding_window=_common_window(self.attention_layers),
            adapters=() if adapters is None else adapters.names,
            inputs=("text", *sorted(getattr(model, "modalities", ()))),
            outputs=("text", "speech") if getattr(model, "speaks", False) else ("text",),
        )
        shape = _cache_shape(config, page_size, kv_dtype or dtype)
        self.cache = self._new_cache(shape, num_pages, device)
        # Builds (or loads) the decode attention kernel now, at start, not in the first pass.
        reads_in_place(self.cache)
        self.in_place_decode = True
        """Decode attention through the in-place kernel where the cache allows (False: gather,
        as `pie bench step` compares)."""
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._stats = DriverStatistics(passes=0, tokens=0, last_pass_seconds=0.0, total_seconds=0.0)

    def _new_cache(self, shape: KvCacheShape, num_pages: int, device: str) -> PagedKvCache:
        # On the CPU the pool stays unwritten (not resident) until passes use its pages.
        lazy = device == "cpu"
        if shape.dtype == torch.int8:
            return Int8PagedKvCache(shape, num_pages, device, value_dtype=self.dtype, lazy=lazy)
        return PagedKvCache(shape, num_pages, device, lazy=lazy)

    @staticmethod
    def pages_for_budget(
        config: ModelConfig, *, budget_bytes: int, page_size: int, dtype: torch.dtype
    ) -> int:
        """num_pages for a KV cache of at most `budget_bytes` with this model's shape."""
        return pages_for_budget(budget_bytes, _cache_shape(config, page_size, dtype))

    def statistics(self) -> DriverStatistics:
        return self._stats

    def page_transfer(self) -> CachePages:
        """Whole KV pages as bytes, for copying a named snapshot to another node."""
        return CachePages(self.cache, self.info.model_name)

    def memory_bytes(self) -> tuple[int, int, int, str]:
        """(model tensors, KV pages used, KV pool, device) for pie.drivers.memory."""
        if self._model_bytes is None:
            self._model_bytes = model_bytes(self.model)
        cache = self.cache
        page = cache.bytes_per_page
        return self._model_bytes, cache.used_pages * page, cache.num_pages * page, self.info.device

    def forward(self, batch: ForwardBatch) -> list[SlotOutput]:
        return self.collect(self.launch(batch))

    def launch(self, batch: ForwardBatch, after: LaunchedPass | None = None) -> LaunchedPass:
        """Checks the batch and queues its pass on the device without waiting for it; the
        batch's `chained` tokens are read from what the slots of `after`, a pass launched
        before it, sampled. `collect` waits for the outputs. A pass launched while another is
        uncollected runs after it (one stream), so the host builds the next pass while the
        device runs the last. Raises DriverError for a malformed batch without changing any
        KV page."""
        started = time.perf_counter()
        with torch.inference_mode():
            validate_batch(batch, self.info)
            chained = self._chained_sources(batch, after)
            self.cache.prepare(batch.kv_page_indices)
            prepared = self._prepare(batch, chained)
            allowed = self._allowed_tokens(batch)
            bias = self._slot_bias(batch)
            self._copy_pages(batch.copies)
            with self._adapters_applied(batch):
                logits = self._slot_logits(batch, prepared, chained)
            readout = None
            if logits is not None:
                readout = launch_slots(logits, batch.slot_ops, self.generator, allowed, bias)
        return LaunchedPass(readout=readout, started=started, tokens=batch.num_tokens)

    def collect(self, launched: LaunchedPass) -> list[SlotOutput]:
        """The outputs of a launched pass, one per sampling slot in the batch's slot order."""
        outputs = [] if launched.readout is None else launched.readout.outputs()
        elapsed = time.perf_counter() - launched.started
        s = self._stats
        self._stats = DriverStatistics(
            passes=s.passes + 1,
            tokens=s.tokens + launched.tokens,
            last_pass_seconds=elapsed,
            total_seconds=s.total_seconds + elapsed,
        )
        return outputs

    @staticmethod
    def _chained_sources(batch: ForwardBatch, after: LaunchedPass | None) -> Chained | None:
        """The device tokens the batch's chained entries read, and where they go."""
        if not batch.chained:
            return None
        previous = None if after is None else after.readout
        sources = [slot for _, slot in batch.chained]
        if previous is None or not all(previous.samples(slot) for slot in sources):
            raise DriverError("a chained token names a slot the pass before does not sample")
        device = previous.flat.device  # type: ignore[union-attr]
        targets = device_tensor([index for index, _ in batch.chained], torch.long, device)
        return targets, previous.tokens_of(sources)

    def _prepare(self, batch: ForwardBatch, chained: Chained | None) -> Any:
        """What the pass needs built before any KV page changes: its attention."""
        return PagedAttention(
            batch, self.cache, self.attention_layers, in_place_decode=self.in_place_decode
        )

    def _adapters_applied(self, batch: ForwardBatch) -> contextlib.AbstractContextManager[None]:
        if self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.applied(batch)

    def _slot_logits(
        self, batch: ForwardBatch, prepared: Any, chained: Chained | None
    ) -> torch.Tensor | None:
        """Runs the model over the batch; float32 logits [slots, vocab], None with no slot."""
        device = self.cache.device
        media = {"media": self._media_rows(batch)} if batch.media else {}
        token_ids = device_tensor(batch.token_ids, torch.long, device)
        if chained is not None:
            token_ids.index_copy_(0, *chained)
        hidden = self.model(
            token_ids,
            device_tensor(self._rope_positions(batch), torch.long, device),
            prepared,
            **media,
        )
        if not batch.slot_ops:
            return None
        slot_tokens = device_tensor(batch.slot_tokens, torch.long, device)
        return self.model.compute_logits(hidden.index_select(0, slot_tokens)).float()

    def _media_rows(self, batch: ForwardBatch) -> MediaRows:
        """The pass's soft tokens, their media encoded first where the store lacks them."""
        if self.media is None:
            raise DriverError(f"model {self.info.model_name!r} reads no media")
        try:
            return self.media.rows(batch.media, self.cache.device, self.dtype)
        except MediaRefused as exc:
            raise DriverError(str(exc)) from None

    def _rope_positions(self, batch: ForwardBatch) -> Sequence[int]:
        return self.model.rope_positions(batch.positions, batch.qo_indptr)

    def _allowed_tokens(self, batch: ForwardBatch) -> torch.Tensor | None:
        """[slots, vocab] bool from each slot's request logit mask; None when none has one."""
        masked = [
            (i, mask)
            for i, r in enumerate(batch.slot_requests)
            if (mask := batch.logit_masks[r]) is not None
        ]
        if not masked:
            return None
        allowed = torch.ones((len(batch.slot_ops), self.info.vocab_size), dtype=torch.bool)
        allowed[[i for i, _ in masked]] = rle_rows([m for _, m in masked], self.info.vocab_size)
        return to_device(allowed, self.cache.device)

    def _slot_bias(self, batch: ForwardBatch) -> torch.Tensor | None:
        """[slots, vocab] float: each slot's request logit biases minus its penalties; None
        when no request has either."""
        if not any(batch.logit_biases) and all(p is None for p in batch.penalties):
            return None
        vocab = self.info.vocab_size
        per_request: dict[int, torch.Tensor] = {}
        for r, (biases, penalty) in enumerate(
            zip(batch.logit_biases, batch.penalties, strict=True)
        ):
            if biases or penalty is not None:
                per_request[r] = request_bias(biases, penalty, vocab)
        bias = torch.zeros((len(batch.slot_ops), vocab), dtype=torch.float32)
        for i, r in enumerate(batch.slot_requests):
            if r in per_request:
                bias[i] = per_request[r]
        return to_device(bias, self.cache.device)

    def _copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        device = self.cache.device
        src = device_tensor([s for s, _ in copies], torch.long, device)
        dst = device_tensor([d for _, d in copies], torch.long, device)
        self.cache.copy_pages(src, dst)


def request_bias(
    biases: Sequence[LogitBias], penalty: Penalty | None, vocab_size: int
) -> torch.Tensor:
    """[vocab] float: the logit biases added up, minus the presence and frequency penalties
    of the tokens the penalty counts."""
    total = torch.zeros(vocab_size, dtype=torch.float32)
    if biases:
        rows = rle_rows([b.mask for b in biases], vocab_size).float()
        total += torch.tensor([b.value for b in biases], dtype=torch.float32) @ rows
    if penalty is not None and penalty.tokens:
        counts = torch.bincount(torch.tensor(penalty.tokens), minlength=vocab_size).float()
        total -= penalty.frequency * counts + penalty.presence * (counts > 0).float()
    return total


def _common_window(layers: Sequence[LayerAttention]) -> int | None:
    """The widest sliding window when every layer has one, else None."""
    windows = [layer.sliding_window for layer in layers]
    if not windows or None in windows:
        return None
    return max(w for w in windows if w is not None)


def _cache_shape(config: ModelConfig, page_size: int, dtype: torch.dtype) -> KvCacheShape:
    return KvCacheShape(
        num_layers=config.num_layers,
        page_size=page_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )
