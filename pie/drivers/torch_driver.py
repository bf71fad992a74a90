"""The plain-torch driver (CPU, or any torch device): checks a batch, applies page copies,
runs the model with paged attention, and reads every sampling slot out of the logits."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from attrs import frozen

from pie.drivers.attention import PagedAttention, rle_rows
from pie.drivers.base import DriverError, DriverInfo
from pie.drivers.batch import ForwardBatch
from pie.drivers.cpu_layers import cpu_layer_kernels
from pie.drivers.decode_attention import reads_in_place
from pie.drivers.kvcache import KvCacheShape, PagedKvCache, pages_for_budget
from pie.drivers.kvcache_int8 import Int8PagedKvCache
from pie.drivers.lora import LoraAdapters
from pie.drivers.media_store import MediaRefused, MediaStore
from pie.drivers.memory import model_bytes
from pie.drivers.models.base import CausalLM, LayerAttention, ModelConfig
from pie.drivers.models.media import MediaRows
from pie.drivers.page_transfer import CachePages
from pie.drivers.sampling import read_slots
from pie.events.sampling import PROBES, SAMPLERS, LogitBias, LogProbs, Penalty, Rle, SlotOutput


@frozen(kw_only=True)
class DriverStatistics:
    """Completed passes so far (refused batches do not count) and their wall time."""

    passes: int
    tokens: int
    last_pass_seconds: float
    total_seconds: float


def _check_rle(runs: Rle, lengths: Sequence[int], what: str) -> None:
    if any(run < 0 for run in runs):
        raise DriverError(f"{what} has a negative run length")
    if sum(runs) not in lengths:
        expected = " or ".join(str(n) for n in lengths)
        raise DriverError(f"{what} runs add up to {sum(runs)}, expected {expected}")


def _check_shape(batch: ForwardBatch, info: DriverInfo) -> None:
    """The flat lists agree with each other and with the driver's limits."""
    r = batch.num_requests
    if len(batch.positions) != batch.num_tokens:
        raise DriverError(
            f"batch has {batch.num_tokens} token ids but {len(batch.positions)} positions"
        )
    per_request = {
        "qo_indptr": len(batch.qo_indptr) - 1,
        "kv_page_indptr": len(batch.kv_page_indptr) - 1,
        "masked_pages": len(batch.masked_pages),
        "attention_masks": len(batch.attention_masks),
        "logit_masks": len(batch.logit_masks),
        "logit_biases": len(batch.logit_biases),
        "penalties": len(batch.penalties),
        "adapters": len(batch.adapters),
    }
    for name, count in per_request.items():
        if count != r:
            raise DriverError(f"batch has {r} requests but {name} describes {count}")
    if batch.qo_indptr[0] != 0 or batch.qo_indptr[-1] != batch.num_tokens:
        raise DriverError(f"qo_indptr does not span the batch's {batch.num_tokens} tokens")
    if batch.kv_page_indptr[0] != 0 or batch.kv_page_indptr[-1] != len(batch.kv_page_indices):
        raise DriverError("kv_page_indptr does not span kv_page_indices")
    if batch.num_tokens > info.max_batch_tokens:
        raise DriverError(f"batch has {batch.num_tokens} tokens, limit {info.max_batch_tokens}")
    if r > info.max_batch_requests:
        raise DriverError(f"batch has {r} requests, limit {info.max_batch_requests}")


def _check_request(batch: ForwardBatch, r: int, info: DriverInfo) -> None:
    """Request r's tokens, pages and attention masks are consistent and in range."""
    what = f"request {r}"
    start, end = batch.qo_indptr[r], batch.qo_indptr[r + 1]
    n, kv_len = end - start, batch.kv_lens[r]
    pages = batch.kv_page_indices[batch.kv_page_indptr[r] : batch.kv_page_indptr[r + 1]]
    if n < 1:
        raise DriverError(f"{what} has no tokens")
    if kv_len < n:
        raise DriverError(f"{what} has kv_len {kv_len}, smaller than its {n} new tokens")
    if len(pages) * info.page_size < kv_len:
        raise DriverError(f"{what} has {len(pages)} pages, too few for kv_len {kv_len}")
    if any(not 0 <= p < info.num_pages for p in pages):
        raise DriverError(f"{what} names a page outside [0, {info.num_pages})")
    if any(not 0 <= p < len(pages) for p in batch.masked_pages[r]):
        raise DriverError(f"{what} masks a page index outside its {len(pages)} pages")
    adapter = batch.adapters[r]
    if adapter is not None and adapter not in info.adapters:
        raise DriverError(f"{what} names adapter {adapter!r}, which is not loaded")
    tokens = batch.token_ids[start:end]
    if min(tokens) < 0 or max(tokens) >= info.vocab_size:
        raise DriverError(f"{what} has a token id outside [0, {info.vocab_size})")
    masks = batch.attention_masks[r]
    if masks is not None:
        if len(masks) != n:
            raise DriverError(f"{what} has {len(masks)} attention masks for {n} tokens")
        for t, mask in enumerate(masks):
            slot = kv_len - n + t
            _check_rle(mask, (slot + 1, kv_len), f"{what} attention mask of token {t}")
    logit_mask = batch.logit_masks[r]
    if logit_mask is not None:
        _check_rle(logit_mask, (info.vocab_size,), f"{what} logit mask")
        if sum(logit_mask[0::2]) == 0:
            raise DriverError(f"{what} logit mask allows no token")
    for i, bias in enumerate(batch.logit_biases[r]):
        _check_rle(bias.mask, (info.vocab_size,), f"{what} logit bias {i}")
        if not math.isfinite(bias.value):
            raise DriverError(f"{what} logit bias {i} is not a finite number")
    penalty = batch.penalties[r]
    if penalty is not None:
        if not (math.isfinite(penalty.presence) and math.isfinite(penalty.frequency)):
            raise DriverError(f"{what} penalty is not a finite number")
        if any(not 0 <= t < info.vocab_size for t in penalty.tokens):
            raise DriverError(f"{what} penalty counts a token outside the vocabulary")


def _check_slots(batch: ForwardBatch, info: DriverInfo) -> None:
    """Each sampling slot reads a token of its own request with a known op."""
    count = len(batch.slot_ops)
    if len(batch.slot_requests) != count or len(batch.slot_tokens) != count:
        raise DriverError("slot_requests, slot_tokens and slot_ops differ in length")
    for i, (r, token, op) in enumerate(
        zip(batch.slot_requests, batch.slot_tokens, batch.slot_ops, strict=True)
    ):
        if not 0 <= r < batch.num_requests:
            raise DriverError(f"slot {i} names request {r}, not in the batch")
        if not batch.qo_indptr[r] <= token < batch.qo_indptr[r + 1]:
            raise DriverError(f"slot {i} of request {r} reads token {token}, not one of its own")
        if not isinstance(op, (*SAMPLERS, *PROBES)):
            raise DriverError(f"slot {i} of request {r} has an unknown op {op!r}")
        if isinstance(op, LogProbs) and any(not 0 <= t < info.vocab_size for t in op.tokens):
            raise DriverError(f"slot {i} of request {r} asks log-probs of a token out of range")


def _check_copies(batch: ForwardBatch, info: DriverInfo) -> None:
    for src, dst in batch.copies:
        if not (0 <= src < info.num_pages and 0 <= dst < info.num_pages):
            raise DriverError(
                f"page copy {src} -> {dst} names a page outside [0, {info.num_pages})"
            )
    destinations = [dst for _, dst in batch.copies]
    if len(set(destinations)) != len(destinations):
        raise DriverError("two page copies write the same page")


def validate_batch(batch: ForwardBatch, info: DriverInfo) -> None:
    """Raises DriverError naming the request and the problem when `batch` is malformed."""
    _check_shape(batch, info)
    for r in range(batch.num_requests):
        _check_request(batch, r, info)
    _check_slots(batch, info)
    _check_copies(batch, info)


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
        started = time.perf_counter()
        with torch.inference_mode():
            outputs = self._run(batch)
        elapsed = time.perf_counter() - started
        s = self._stats
        self._stats = DriverStatistics(
            passes=s.passes + 1,
            tokens=s.tokens + batch.num_tokens,
            last_pass_seconds=elapsed,
            total_seconds=s.total_seconds + elapsed,
        )
        return outputs

    def _run(self, batch: ForwardBatch) -> list[SlotOutput]:
        validate_batch(batch, self.info)
        self.cache.prepare(batch.kv_page_indices)
        prepared = self._prepare(batch)
        allowed = self._allowed_tokens(batch)
        bias = self._slot_bias(batch)
        self._copy_pages(batch.copies)
        with self._adapters_applied(batch):
            logits = self._slot_logits(batch, prepared)
        if logits is None:
            return []
        return read_slots(logits, batch.slot_ops, self.generator, allowed, bias)

    def _prepare(self, batch: ForwardBatch) -> Any:
        """What the pass needs built before any KV page changes: its attention."""
        return PagedAttention(
            batch, self.cache, self.attention_layers, in_place_decode=self.in_place_decode
        )

    def _adapters_applied(self, batch: ForwardBatch) -> contextlib.AbstractContextManager[None]:
        if self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.applied(batch)

    def _slot_logits(self, batch: ForwardBatch, prepared: Any) -> torch.Tensor | None:
        """Runs the model over the batch; float32 logits [slots, vocab], None with no slot."""
        device = self.cache.device
        media = {"media": self._media_rows(batch)} if batch.media else {}
        hidden = self.model(
            torch.tensor(batch.token_ids, dtype=torch.long, device=device),
            torch.tensor(self._rope_positions(batch), dtype=torch.long, device=device),
            prepared,
            **media,
        )
        if not batch.slot_ops:
            return None
        slot_tokens = torch.tensor(batch.slot_tokens, dtype=torch.long, device=device)
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
        return allowed.to(self.cache.device)

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
        return bias.to(self.cache.device)

    def _copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        device = self.cache.device
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
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
