"""Building blocks of the driver contract: requests placed in pages the way the kv actor places
them, reading outputs back, and which tokens each sampler may draw from given logits."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytest
import torch

from pie.drivers.base import Driver, DriverInfo
from pie.drivers.batch import ForwardBatch
from pie.events.forward import ForwardRequest
from pie.events.sampling import (
    Argmax,
    Distribution,
    DistributionOutput,
    Entropy,
    EntropyOutput,
    LogitsOutput,
    LogProbs,
    LogProbsOutput,
    MinP,
    Multinomial,
    RawLogits,
    SamplingSlot,
    SlotOp,
    SlotOutput,
    TokenOutput,
    TopK,
    TopKTopP,
    TopP,
)

NewDriver = Callable[[], Driver]
Reference = Callable[[Sequence[int]], torch.Tensor]

PROBE_TOLERANCE = 1e-4
"""Probes computed by the driver in float32 from the logits it reports, against ours in float64."""


class DriverRunner:
    """What a runner of the driver contract states about its driver; see DriverContract."""

    computes_model: ClassVar[bool]
    """True for a real model: logits depend on every visible kv slot, and every sampler and probe
    is a function of the logits RawLogits reports. False (the synthetic driver): outputs depend
    on the slot's token only, and the contract checks the weaker properties that still hold."""
    reference_tolerance: ClassVar[float]
    """Max abs difference of a logit from `reference_logits`."""
    logit_tolerance: ClassVar[float]
    """Max abs difference between logits of the same context position computed in passes of a
    different shape (chunking, batching, page placement, masks)."""
    mask_effect: ClassVar[float | None] = None
    """How far an attention mask must move a real model's logits for the contract to see it
    (None: 100 * logit_tolerance; a bfloat16 driver needs a floor of its own)."""
    batch_invariant_tokens: ClassVar[bool] = True
    """Argmax and seeded draws give the same token whatever else shares the pass."""

    @pytest.fixture
    def new_driver(self) -> NewDriver:
        raise NotImplementedError("the runner provides a factory of fresh drivers")

    @pytest.fixture
    def reference_logits(self) -> Reference:
        raise NotImplementedError("the runner provides reference logits of one sequence")


def op_name(op: object) -> str:
    return type(op).__name__ + ("-seeded" if getattr(op, "seed", None) is not None else "")


def request(
    kv_start: int,
    tokens: Sequence[int],
    pages: Sequence[int],
    ops: Sequence[SlotOp] = (RawLogits(),),
    **fields: Any,
) -> ForwardRequest:
    """`tokens` appended after `kv_start` tokens of a context; every op reads the last token
    unless `slots` says otherwise; positions continue from kv_start unless given."""
    n = len(tokens)
    fields.setdefault("positions", tuple(range(kv_start, kv_start + n)))
    fields.setdefault("slots", tuple(SamplingSlot(index=n - 1, op=op) for op in ops))
    return ForwardRequest(
        corr=0,
        requester="contract",
        context=0,
        tokens=tuple(tokens),
        kv_start=kv_start,
        pages=tuple(pages),
        **fields,
    )


def every_token(n: int) -> tuple[SamplingSlot, ...]:
    """RawLogits at each of a request's n tokens."""
    return tuple(SamplingSlot(index=i, op=RawLogits()) for i in range(n))


def run(driver: Driver, *requests: ForwardRequest) -> list[SlotOutput]:
    return driver.forward(ForwardBatch.from_requests(requests))


class PageSupply:
    """Hands out distinct page ids of a driver's pool in a shuffled order, so that no context's
    pages are contiguous or ascending."""

    def __init__(self, info: DriverInfo, seed: int = 0) -> None:
        self.page_size = info.page_size
        self._free = list(range(info.num_pages))
        random.Random(seed).shuffle(self._free)

    def take(self, count: int) -> tuple[int, ...]:
        assert count <= len(self._free), "the driver's pool is too small for this test"
        taken, self._free = self._free[:count], self._free[count:]
        return tuple(taken)

    def for_tokens(self, length: int) -> tuple[int, ...]:
        return self.take(-(-length // self.page_size))


def prompt(info: DriverInfo, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(info.vocab_size) for _ in range(length)]


def logits_of(output: SlotOutput) -> torch.Tensor:
    assert isinstance(output, LogitsOutput), output
    return torch.tensor(output.values, dtype=torch.float64)


def token_of(output: SlotOutput) -> int:
    assert isinstance(output, TokenOutput), output
    return output.token


def tokens_of(outputs: Sequence[SlotOutput]) -> list[int]:
    return [token_of(out) for out in outputs]


def distribution_of(output: SlotOutput) -> DistributionOutput:
    assert isinstance(output, DistributionOutput), output
    return output


def logprobs_of(output: SlotOutput) -> tuple[float, ...]:
    assert isinstance(output, LogProbsOutput), output
    return output.values


def entropy_of(output: SlotOutput) -> float:
    assert isinstance(output, EntropyOutput), output
    return output.value


def assert_close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """Equal within `tolerance` absolute, with -inf only where the other has -inf."""
    got, want = got.double(), want.double()
    assert torch.equal(got.isneginf(), want.isneginf()), "masked entries differ"
    finite = ~want.isneginf()
    worst = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert worst <= tolerance, f"max abs difference {worst:.3g} > {tolerance:.3g}"


EVERY_OP: tuple[SlotOp, ...] = (
    Argmax(),
    Multinomial(temperature=0.8),
    TopK(k=3),
    TopP(p=0.8),
    MinP(p=0.1),
    TopKTopP(k=5, p=0.8),
    Distribution(k=4),
    RawLogits(),
    LogProbs(tokens=(0, 1, 2)),
    Entropy(),
)


def _page_past_the_pool(batch: ForwardBatch, info: DriverInfo, supply: PageSupply) -> None:
    batch.kv_page_indices[-1] = info.num_pages


def _negative_page(batch: ForwardBatch, info: DriverInfo, supply: PageSupply) -> None:
    batch.kv_page_indices[-1] = -1


def _copy_from_past_the_pool(batch: ForwardBatch, info: DriverInfo, supply: PageSupply) -> None:
    [page] = supply.take(1)
    batch.copies.append((info.num_pages, page))


def _copy_onto_a_negative_page(batch: ForwardBatch, info: DriverInfo, supply: PageSupply) -> None:
    [page] = supply.take(1)
    batch.copies.append((page, -1))


def _one_token_too_many(batch: ForwardBatch, info: DriverInfo, supply: PageSupply) -> None:
    n = info.max_batch_tokens - batch.num_tokens + 1
    batch.add(request(0, [1] * n, supply.for_tokens(n), ()))


def _one_request_too_many(batch: ForwardBatch, info: DriverInfo, supply: PageSupply) -> None:
    for _ in range(info.max_batch_requests - batch.num_requests + 1):
        batch.add(request(0, [1], supply.take(1), ()))


REFUSALS = {
    f.__name__.strip("_").replace("_", " "): f
    for f in (
        _page_past_the_pool,
        _negative_page,
        _copy_from_past_the_pool,
        _copy_onto_a_negative_page,
        _one_token_too_many,
        _one_request_too_many,
    )
}
"""Ways to spoil a valid batch that every driver must refuse: page ids outside its pool, in the
page table or in a page copy, and sizes over its limits."""


MASS_SLACK = 1e-4
"""Probability mass by which a filter's boundary may move between the driver's arithmetic and
ours: tokens this close to the boundary count as allowed."""


def nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """The smallest set of most likely tokens reaching mass p, widened by MASS_SLACK."""
    ordered, index = probs.sort(descending=True)
    before = ordered.cumsum(0) - ordered
    return set(index[before < p + MASS_SLACK].tolist())


def best(logits: torch.Tensor, k: int) -> set[int]:
    """The k largest logits, and any token tied with the k-th."""
    kth = logits.topk(min(k, logits.numel())).values[-1]
    return set((logits >= kth).nonzero().view(-1).tolist())


def allowed_by(op: SlotOp, logits: torch.Tensor) -> set[int]:
    """Tokens `op` may draw from `logits` [V] (-inf for masked tokens), by the op's definition."""
    logits = logits.double()
    possible = set((~logits.isneginf()).nonzero().view(-1).tolist())
    if isinstance(op, Argmax):
        return set((logits == logits.max()).nonzero().view(-1).tolist())
    assert isinstance(op, Multinomial | TopK | TopP | MinP | TopKTopP), f"not a sampler: {op!r}"
    probs = (logits / op.temperature).softmax(-1)
    match op:
        case Multinomial():
            return possible
        case TopK(k=k):
            return best(logits, k) & possible
        case TopP(p=p):
            return nucleus(probs, p) & possible
        case MinP(p=p):
            floor = p * probs.max() - MASS_SLACK
            return set((probs >= floor).nonzero().view(-1).tolist()) & possible
        case TopKTopP(k=k, p=p):
            kept = sorted(best(logits, k) & possible)
            renormalised = torch.zeros_like(probs)
            renormalised[kept] = probs[kept] / probs[kept].sum()
            return nucleus(renormalised, p) & set(kept)
    raise AssertionError(f"not a sampler: {op!r}")


def entropy(logits: torch.Tensor) -> float:
    probs = logits.double().softmax(-1)
    return float(torch.special.entr(probs).sum())
