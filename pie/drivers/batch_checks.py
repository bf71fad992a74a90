"""The checks every driver makes of a batch before it touches a KV page: the flat lists agree
with each other and with the driver's limits, and every index, mask, slot and copy is in range."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pie.drivers.base import DriverError, DriverInfo
from pie.drivers.batch import ForwardBatch
from pie.events.sampling import PROBES, SAMPLERS, LogProbs, Rle

__all__ = ["validate_batch"]


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
    _check_chained(batch)


def _check_chained(batch: ForwardBatch) -> None:
    targets = [index for index, _ in batch.chained]
    if any(not 0 <= index < batch.num_tokens for index in targets):
        raise DriverError(f"a chained token lies outside the batch's {batch.num_tokens} tokens")
    if len(set(targets)) != len(targets):
        raise DriverError("two chained tokens name the same token")
