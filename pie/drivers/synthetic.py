"""A driver with no model whose pass takes a fixed time: for benchmarking the runtime around
forward passes and for engine tests that need no weights.

Its "model" predicts token (t + 1) % vocab after token t, so outputs are easy to check.
"""

from __future__ import annotations

import os
import time

from pie.drivers.base import DriverError, DriverInfo
from pie.drivers.batch import ForwardBatch
from pie.events.sampling import (
    SAMPLERS,
    Distribution,
    DistributionOutput,
    Entropy,
    EntropyOutput,
    LogitsOutput,
    LogProbs,
    LogProbsOutput,
    RawLogits,
    SlotOp,
    SlotOutput,
    TokenOutput,
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
    ) -> None:
        self.pass_seconds = pass_seconds
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

    def forward(self, batch: ForwardBatch) -> list[SlotOutput]:
        pages = batch.kv_page_indices
        if pages and (min(pages) < 0 or max(pages) >= self.info.num_pages):
            raise DriverError("page index out of range")
        started = time.perf_counter()
        self.batches.append(batch)
        outputs = [
            self._read(batch.token_ids[t], op)
            for t, op in zip(batch.slot_tokens, batch.slot_ops, strict=True)
        ]
        _wait_until(started + self.pass_seconds)
        return outputs

    def _read(self, token: int, op: SlotOp) -> SlotOutput:
        following = (token + 1) % self.info.vocab_size
        if isinstance(op, SAMPLERS):
            return TokenOutput(token=following)
        if isinstance(op, Distribution):
            return DistributionOutput(tokens=(following,), probs=(1.0,))
        if isinstance(op, RawLogits):
            return LogitsOutput(
                values=tuple(1.0 if i == following else 0.0 for i in range(self.info.vocab_size))
            )
        if isinstance(op, LogProbs):
            return LogProbsOutput(
                values=tuple(0.0 if t == following else float("-inf") for t in op.tokens)
            )
        if isinstance(op, Entropy):
            return EntropyOutput(value=0.0)
        raise DriverError(f"unknown slot op {op!r}")


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
