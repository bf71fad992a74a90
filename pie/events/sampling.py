"""What a forward pass reads out at a token: samplers and probes, and what they return.

These are plain values shared by the actors (which route them) and the drivers (which run them).
"""

from __future__ import annotations

from typing import Any, TypeAlias

import attrs
from attrs import frozen

Rle: TypeAlias = tuple[int, ...]
"""A boolean mask as run lengths, alternating True/False and starting with True.

A leading 0 starts the mask with a False run. The runs must add up to the mask's length.
"""


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _probability(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


def _min_one(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@frozen(kw_only=True)
class LogitBias:
    """Adds `value` to the logits of the tokens `mask` selects (run lengths over the vocabulary),
    before the logit mask, samplers and probes: `logit_bias` of the OpenAI API, watermarks."""

    mask: Rle
    value: float


@frozen(kw_only=True)
class Penalty:
    """Presence and frequency penalties over `tokens` (a generation's output so far): a token
    that occurs c times there has `frequency * c + presence * (c > 0)` taken off its logit,
    after the logit biases and before the mask, samplers and probes (the OpenAI API's rule)."""

    presence: float
    frequency: float
    tokens: tuple[int, ...]


@frozen(kw_only=True)
class Argmax:
    """The most likely token (greedy)."""


@frozen(kw_only=True)
class Multinomial:
    """A token drawn from softmax(logits / temperature)."""

    temperature: float = attrs.field(default=1.0, validator=_positive)
    seed: int | None = None


@frozen(kw_only=True)
class TopK:
    """A token drawn from the k most likely, renormalised."""

    temperature: float = attrs.field(default=1.0, validator=_positive)
    k: int = attrs.field(default=50, validator=_min_one)
    seed: int | None = None


@frozen(kw_only=True)
class TopP:
    """A token drawn from the smallest set whose probability reaches p (nucleus)."""

    temperature: float = attrs.field(default=1.0, validator=_positive)
    p: float = attrs.field(default=0.9, validator=_probability)
    seed: int | None = None


@frozen(kw_only=True)
class MinP:
    """A token drawn from those with probability >= p * (probability of the best token)."""

    temperature: float = attrs.field(default=1.0, validator=_positive)
    p: float = attrs.field(default=0.1, validator=_probability)
    seed: int | None = None


@frozen(kw_only=True)
class TopKTopP:
    """Top-k filtering, then nucleus filtering of what is left, then a draw."""

    temperature: float = attrs.field(default=1.0, validator=_positive)
    k: int = attrs.field(default=50, validator=_min_one)
    p: float = attrs.field(default=0.9, validator=_probability)
    seed: int | None = None


Sampler: TypeAlias = Argmax | Multinomial | TopK | TopP | MinP | TopKTopP


@frozen(kw_only=True)
class Distribution:
    """Probe: the k most likely tokens and their probabilities, softmax(logits / temperature)."""

    k: int = attrs.field(default=10, validator=_min_one)
    temperature: float = attrs.field(default=1.0, validator=_positive)


@frozen(kw_only=True)
class RawLogits:
    """Probe: the full logit vector (after the logit mask)."""


@frozen(kw_only=True)
class LogProbs:
    """Probe: log-probabilities of the given tokens under softmax(logits)."""

    tokens: tuple[int, ...]


@frozen(kw_only=True)
class Entropy:
    """Probe: entropy (nats) of softmax(logits)."""


Probe: TypeAlias = Distribution | RawLogits | LogProbs | Entropy
SlotOp: TypeAlias = Sampler | Probe


@frozen(kw_only=True)
class SamplingSlot:
    """Read `op` out at the request's `index`-th input token."""

    index: int
    op: SlotOp


@frozen(kw_only=True)
class TokenOutput:
    token: int


@frozen(kw_only=True)
class DistributionOutput:
    tokens: tuple[int, ...]
    probs: tuple[float, ...]


@frozen(kw_only=True)
class LogitsOutput:
    values: tuple[float, ...]


@frozen(kw_only=True)
class LogProbsOutput:
    values: tuple[float, ...]


@frozen(kw_only=True)
class EntropyOutput:
    value: float


SlotOutput: TypeAlias = (
    TokenOutput | DistributionOutput | LogitsOutput | LogProbsOutput | EntropyOutput
)

SAMPLERS = (Argmax, Multinomial, TopK, TopP, MinP, TopKTopP)
PROBES = (Distribution, RawLogits, LogProbs, Entropy)


def rle_to_bools(runs: Rle, length: int) -> list[bool]:
    """Expands run lengths into `length` booleans; raises ValueError if they do not add up."""
    if any(r < 0 for r in runs):
        raise ValueError("mask run lengths must be >= 0")
    if sum(runs) != length:
        raise ValueError(f"mask runs add up to {sum(runs)}, expected {length}")
    out: list[bool] = []
    value = True
    for run in runs:
        out.extend([value] * run)
        value = not value
    return out


def bools_to_rle(mask: list[bool] | tuple[bool, ...]) -> Rle:
    """The run-length form of a boolean mask (inverse of rle_to_bools)."""
    runs: list[int] = []
    value = True
    count = 0
    for bit in mask:
        if bool(bit) == value:
            count += 1
        else:
            runs.append(count)
            value = not value
            count = 1
    runs.append(count)
    return tuple(runs)
