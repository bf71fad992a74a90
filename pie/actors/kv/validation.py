"""Checks on what a requester submits, so that a bad pass fails alone with a clear reason
instead of reaching the driver."""

from __future__ import annotations

from collections.abc import Collection

from attrs import frozen

from pie.events.kv import SubmitForward
from pie.events.sampling import Distribution, LogitBias, LogProbs, Penalty, RawLogits, SlotOp

MAX_POSITION = 2**31
"""Attention kernels (flashinfer) take positions as int32; the page hash packs them as int64."""


@frozen(kw_only=True)
class OutputLimits:
    """What one pass may ask the driver to read out: its sampling and probe slots, and the
    values all of them return together (a raw-logits row is the vocabulary, a distribution two
    per token it lists, logprobs one per token, anything else one)."""

    max_slots: int = 512
    max_values: int = 1 << 22


class RequestError(Exception):
    """A command the kv actor refuses; `kind` is a stable word for programs."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def check_adapter(adapter: str | None, loaded: Collection[str]) -> None:
    """Raises RequestError("no_such_adapter", ...) for a pass naming an adapter not loaded."""
    if adapter is not None and adapter not in loaded:
        known = ", ".join(sorted(loaded)) or "none"
        raise RequestError(
            "no_such_adapter", f"no LoRA adapter named {adapter[:64]!r}; loaded: {known}"
        )


def validate_forward(
    event: SubmitForward, length: int, vocab_size: int, limits: OutputLimits | None = None
) -> None:
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
    _check_media(event, count)
    _check_outputs(event, vocab_size, limits or OutputLimits())
    if event.logit_mask is not None:
        _check_runs("logit mask", event.logit_mask, (vocab_size,))
    _check_biases(event.logit_bias, vocab_size)
    if event.penalty is not None:
        _check_penalty(event.penalty, vocab_size)
    if event.attention_masks is not None:
        if len(event.attention_masks) != count:
            raise RequestError(
                "invalid", f"{len(event.attention_masks)} attention masks for {count} tokens"
            )
        for i, runs in enumerate(event.attention_masks):
            _check_runs(f"attention mask of token {i}", runs, (length + i + 1, length + count))


def _check_media(event: SubmitForward, count: int) -> None:
    """Media runs lie among the pass's tokens, in order and apart."""
    end = 0
    for run in event.media:
        if run.count < 1 or run.offset < 0 or run.index < end or run.index + run.count > count:
            raise RequestError(
                "invalid",
                f"media run at token {run.index} ({run.count} tokens) must lie within the "
                f"pass's {count} tokens, after the run before it",
            )
        end = run.index + run.count


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


def _check_outputs(event: SubmitForward, vocab_size: int, limits: OutputLimits) -> None:
    if len(event.slots) > limits.max_slots:
        raise RequestError(
            "invalid",
            f"{len(event.slots)} sampling and probe slots in one pass; at most "
            f"{limits.max_slots} ([scheduler] max_slots_per_pass)",
        )
    values = sum(_values(slot.op, vocab_size) for slot in event.slots)
    if values > limits.max_values:
        raise RequestError(
            "invalid",
            f"the pass's slots would return {values} values; at most {limits.max_values} "
            "([scheduler] max_probe_values)",
        )


def _values(op: SlotOp, vocab_size: int) -> int:
    match op:
        case RawLogits():
            return vocab_size
        case Distribution():
            return 2 * min(op.k, vocab_size)
        case LogProbs():
            return len(op.tokens)
    return 1


MAX_BIASES = 64
MAX_BIAS = 100.0


def _check_biases(biases: tuple[LogitBias, ...], vocab_size: int) -> None:
    if len(biases) > MAX_BIASES:
        raise RequestError("invalid", f"at most {MAX_BIASES} logit biases per pass")
    for i, bias in enumerate(biases):
        _check_runs(f"logit bias {i}", bias.mask, (vocab_size,))
        if not -MAX_BIAS <= bias.value <= MAX_BIAS:
            raise RequestError(
                "invalid", f"logit bias {i}: a value from -{MAX_BIAS:g} to {MAX_BIAS:g}"
            )


MAX_PENALTY = 2.0
MAX_PENALTY_TOKENS = 1 << 16


def _check_penalty(penalty: Penalty, vocab_size: int) -> None:
    for name, value in (("presence", penalty.presence), ("frequency", penalty.frequency)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise RequestError(
                "invalid", f"{name} penalty: a value from -{MAX_PENALTY:g} to {MAX_PENALTY:g}"
            )
    if len(penalty.tokens) > MAX_PENALTY_TOKENS:
        raise RequestError("invalid", f"a penalty counts at most {MAX_PENALTY_TOKENS} tokens")
    bad = [t for t in penalty.tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestError("invalid", f"penalty tokens {bad[:5]} outside the vocabulary")


def _check_runs(what: str, runs: tuple[int, ...], lengths: tuple[int, ...]) -> None:
    if any(r < 0 for r in runs):
        raise RequestError("invalid", f"{what} has a negative run length")
    if sum(runs) not in lengths:
        want = " or ".join(str(n) for n in sorted(set(lengths)))
        raise RequestError("invalid", f"{what} covers {sum(runs)} entries, expected {want}")
