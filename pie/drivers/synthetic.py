"""A driver with no model whose pass takes a fixed time: for benchmarking the runtime around
forward passes and for engine tests that need no weights.

Its "model" predicts token (t + 1) % vocab after token t, so outputs are easy to check.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence

from pie.drivers.base import DriverError, DriverInfo
from pie.drivers.batch import ForwardBatch
from pie.events.sampling import (
    SAMPLERS,
    Distribution,
    DistributionOutput,
    Entropy,
    EntropyOutput,
    LogitBias,
    LogitsOutput,
    LogProbs,
    LogProbsOutput,
    Penalty,
    RawLogits,
    Rle,
    SlotOp,
    SlotOutput,
    TokenOutput,
    rle_to_bools,
)


class SyntheticDriver:
    def __init__(
        self,
        *,
        pass_seconds: float = 0.0,
        vocab_size: int = 1000,
        page_size: int = 16,
        num_pages: int = 4096,
        max_batch_tokens: int = 512,
        max_batch_requests: int = 64,
        keep_batches: bool = True,
    ) -> None:
        self.pass_seconds = pass_seconds
        self.keep_batches = keep_batches
        """Whether `batches` keeps every pass's batch (tests read them; a benchmark's growing
        list would be walked by every full collection)."""
        self.info = DriverInfo(
            model_name="synthetic",
            vocab_size=vocab_size,
            page_size=page_size,
            num_pages=num_pages,
            max_batch_tokens=max_batch_tokens,
            max_batch_requests=max_batch_requests,
            device="cpu",
            dtype="none",
        )
        self.batches: list[ForwardBatch] = []
        self.pages: dict[int, bytes] = {}
        """What `page_transfer` wrote into each page (the model writes no KV)."""

    def page_transfer(self) -> SyntheticPages:
        return SyntheticPages(self)

    def forward(self, batch: ForwardBatch) -> list[SlotOutput]:
        # The pass's own bookkeeping counts toward its fixed time, as a real pass's would.
        started = time.perf_counter()
        self._check(batch)
        vocab = self.info.vocab_size
        allowed = [None if m is None else _allowed(m, vocab) for m in batch.logit_masks]
        biases = [
            _biases(b, p, vocab) if b or p is not None else None
            for b, p in zip(batch.logit_biases, batch.penalties, strict=True)
        ]
        if self.keep_batches:
            self.batches.append(batch)
        outputs = [
            self._read(batch.token_ids[t], op, allowed[r], biases[r])
            for r, t, op in zip(batch.slot_requests, batch.slot_tokens, batch.slot_ops, strict=True)
        ]
        _wait_until(started + self.pass_seconds)
        return outputs

    def _check(self, batch: ForwardBatch) -> None:
        info = self.info
        if batch.num_tokens > info.max_batch_tokens:
            raise DriverError(f"batch has {batch.num_tokens} tokens, limit {info.max_batch_tokens}")
        if batch.num_requests > info.max_batch_requests:
            raise DriverError(
                f"batch has {batch.num_requests} requests, limit {info.max_batch_requests}"
            )
        pages = [*batch.kv_page_indices, *(p for copy in batch.copies for p in copy)]
        if pages and (min(pages) < 0 or max(pages) >= info.num_pages):
            raise DriverError("page index out of range")

    def _read(
        self, token: int, op: SlotOp, allowed: list[bool] | None, bias: list[float] | None
    ) -> SlotOutput:
        vocab = self.info.vocab_size
        nominal = (token + 1) % vocab
        following = nominal
        if bias is not None:
            # The nominal token's logit is 1 and every other's 0, before the bias.
            scores = [b + (i == nominal) for i, b in enumerate(bias)]
            if allowed is not None:
                scores = [x if ok else float("-inf") for x, ok in zip(scores, allowed, strict=True)]
            following = scores.index(max(scores))
        elif allowed is not None and not allowed[nominal]:
            # Every allowed token's logit is 0 then; the first of them is the argmax.
            following = allowed.index(True)
        if isinstance(op, SAMPLERS):
            return TokenOutput(token=following)
        if isinstance(op, Distribution):
            return DistributionOutput(tokens=(following,), probs=(1.0,))
        if isinstance(op, RawLogits):
            values = [1.0 if i == nominal else 0.0 for i in range(vocab)]
            if bias is not None:
                values = [v + b for v, b in zip(values, bias, strict=True)]
            if allowed is not None:
                values = [v if ok else float("-inf") for v, ok in zip(values, allowed, strict=True)]
            return LogitsOutput(values=tuple(values))
        if isinstance(op, LogProbs):
            return LogProbsOutput(
                values=tuple(0.0 if t == following else float("-inf") for t in op.tokens)
            )
        if isinstance(op, Entropy):
            return EntropyOutput(value=0.0)
        raise DriverError(f"unknown slot op {op!r}")


def _biases(biases: tuple[LogitBias, ...], penalty: Penalty | None, vocab_size: int) -> list[float]:
    total = [0.0] * vocab_size
    if penalty is not None:
        for token, count in Counter(penalty.tokens).items():
            total[token] -= penalty.frequency * count + penalty.presence
    for bias in biases:
        try:
            selected = rle_to_bools(bias.mask, vocab_size)
        except ValueError as err:
            raise DriverError(f"logit bias: {err}") from None
        for i, chosen in enumerate(selected):
            if chosen:
                total[i] += bias.value
    return total


def _allowed(logit_mask: Rle, vocab_size: int) -> list[bool]:
    try:
        allowed = rle_to_bools(logit_mask, vocab_size)
    except ValueError as err:
        raise DriverError(f"logit mask: {err}") from None
    if not any(allowed):
        raise DriverError("logit mask allows no token")
    return allowed


_SPIN_SECONDS = 0.0003
"""`time.sleep` overshoots by 0.1-0.2 ms; the last stretch is spun (yielding the processor and
the GIL each turn: `time.sleep(0)` would sleep out the timer slack, about 50 us) so that a
pass takes its stated time and benchmarks do not count the overshoot as runtime overhead."""


def _wait_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > _SPIN_SECONDS:
        time.sleep(remaining - _SPIN_SECONDS)
    while time.perf_counter() < deadline:
        os.sched_yield()


class SyntheticPages:
    """Pages as PAGE_BYTES bytes each: zeros until imported (the synthetic model keeps no KV)."""

    page_bytes = 16

    def __init__(self, driver: SyntheticDriver) -> None:
        self.driver = driver
        info = driver.info
        self.layout = f"{info.model_name} synthetic page_size={info.page_size}"

    def export_pages(self, pages: Sequence[int]) -> bytes:
        self._check(pages)
        blank = bytes(self.page_bytes)
        return b"".join(self.driver.pages.get(page, blank) for page in pages)

    def import_pages(self, pages: Sequence[int], data: bytes) -> None:
        self._check(pages)
        if len(data) != len(pages) * self.page_bytes:
            raise ValueError(f"{len(data)} bytes are not {len(pages)} pages of {self.page_bytes}")
        for i, page in enumerate(pages):
            self.driver.pages[page] = data[i * self.page_bytes : (i + 1) * self.page_bytes]

    def _check(self, pages: Sequence[int]) -> None:
        if any(not 0 <= p < self.driver.info.num_pages for p in pages):
            raise ValueError(f"page index outside 0..{self.driver.info.num_pages - 1}")
