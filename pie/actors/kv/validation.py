"""Checks on what a requester submits, so that a bad pass fails alone with a clear reason
instead of reaching the driver."""

from __future__ import annotations

from pie.events.kv import SubmitForward
from pie.events.sampling import LogProbs

MAX_POSITION = 2**31
"""Attention kernels (flashinfer) take positions as int32; the page hash packs them as int64."""


class RequestError(Exception):
    """A command the kv actor refuses; `kind` is a stable word for programs."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def validate_forward(event: SubmitForward, length: int, vocab_size: int) -> None:
    """Raises RequestError("invalid", ...) naming the first problem with a pass."""
    count = len(event.tokens)
    if count == 0:
        raise RequestError("invalid", "a forward pass needs at least one input token")
    bad = [t for t in event.tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            "invalid", f"token ids {bad[:5]} outside the vocabulary 0..{vocab_size - 1}"
        )
    if event.positions is not None and len(event.positions) != count:
        raise RequestError("invalid", f"{len(event.positions)} positions for {count} tokens")
    if event.positions is not None and any(not 0 <= p < MAX_POSITION for p in event.positions):
        raise RequestError("invalid", f"positions must be in 0..{MAX_POSITION - 1}")
    _check_slots(event, count, vocab_size)
    if event.logit_mask is not None:
        _check_runs("logit mask", event.logit_mask, (vocab_size,))
    if event.attention_masks is not None:
        if len(event.attention_masks) != count:
            raise RequestError(
                "invalid", f"{len(event.attention_masks)} attention masks for {count} tokens"
            )
        for i, runs in enumerate(event.attention_masks):
            _check_runs(f"attention mask of token {i}", runs, (length + i + 1, length + count))


def _check_slots(event: SubmitForward, count: int, vocab_size: int) -> None:
    for slot in event.slots:
        if not 0 <= slot.index < count:
            raise RequestError(
                "invalid", f"sampling slot index {slot.index} outside 0..{count - 1}"
            )
        if isinstance(slot.op, LogProbs):
            bad = [t for t in slot.op.tokens if not 0 <= t < vocab_size]
            if bad:
                raise RequestError("invalid", f"logprob tokens {bad[:5]} outside the vocabulary")


def _check_runs(what: str, runs: tuple[int, ...], lengths: tuple[int, ...]) -> None:
    if any(r < 0 for r in runs):
        raise RequestError("invalid", f"{what} has a negative run length")
    if sum(runs) not in lengths:
        want = " or ".join(str(n) for n in sorted(set(lengths)))
        raise RequestError("invalid", f"{what} covers {sum(runs)} entries, expected {want}")
