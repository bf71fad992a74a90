"""Samplers keep to their definitions on crafted logits, seeded draws reproduce, logit masks
hold for every sampler, and probes match direct torch computations."""

from __future__ import annotations

import math

import pytest
import torch

from pie.drivers.sampling import read_slots
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
    SlotOp,
    TokenOutput,
    TopK,
    TopKTopP,
    TopP,
)

pytestmark = pytest.mark.unit

VOCAB = 24
DRAWS = 4000


@pytest.fixture
def logits() -> torch.Tensor:
    """Distinct, shuffled logits, so that "the k best" is a scattered set of ids."""
    g = torch.Generator().manual_seed(7)
    return torch.linspace(3.0, -3.0, VOCAB)[torch.randperm(VOCAB, generator=g)]


def drawn(row: torch.Tensor, op: SlotOp, count: int = DRAWS) -> list[int]:
    """Tokens drawn by `count` slots that all read the same logits with the same op."""
    outputs = read_slots(row.expand(count, -1), [op] * count, torch.Generator().manual_seed(1))
    tokens = []
    for out in outputs:
        assert isinstance(out, TokenOutput)
        tokens.append(out.token)
    return tokens


def best(row: torch.Tensor, k: int) -> set[int]:
    return set(row.topk(k).indices.tolist())


def nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """The smallest set of most likely tokens whose probability reaches p."""
    kept: set[int] = set()
    mass = 0.0
    for token in probs.argsort(descending=True).tolist():
        kept.add(token)
        mass += float(probs[token])
        if mass >= p:
            break
    return kept


def test_top_k_only_draws_from_the_k_best(logits: torch.Tensor) -> None:
    assert set(drawn(logits, TopK(k=5))) == best(logits, 5)


def test_a_seeded_top_k_slot_draws_from_all_k_best_on_its_own(logits: torch.Tensor) -> None:
    """A seeded slot is drawn alone, as a batch of one row: k still counts tokens, not rows."""
    tokens = set()
    for seed in range(300):
        [out] = read_slots(logits[None], [TopK(k=5, seed=seed)], torch.Generator())
        assert isinstance(out, TokenOutput)
        tokens.add(out.token)
    assert tokens == best(logits, 5)


def test_top_p_only_draws_from_the_nucleus(logits: torch.Tensor) -> None:
    allowed = nucleus(logits.softmax(-1), 0.7)
    assert 1 < len(allowed) < VOCAB
    assert set(drawn(logits, TopP(p=0.7))) == allowed


def test_top_p_keeps_at_least_one_token(logits: torch.Tensor) -> None:
    peaked = logits.clone()
    peaked[3] = 50.0
    assert set(drawn(peaked, TopP(p=0.01), count=200)) == {3}


def test_top_p_stops_at_the_token_whose_mass_reaches_p() -> None:
    """Four equally likely tokens: two of them reach p = 0.5 exactly, so two are kept."""
    assert len(set(drawn(torch.zeros(4), TopP(p=0.5), count=400))) == 2


def test_min_p_never_draws_below_the_threshold(logits: torch.Tensor) -> None:
    probs = logits.softmax(-1)
    allowed = {t for t in range(VOCAB) if probs[t] >= 0.2 * probs.max()}
    assert set(drawn(logits, MinP(p=0.2))) == allowed


def test_min_p_keeps_tokens_exactly_at_the_threshold() -> None:
    assert set(drawn(torch.zeros(4), MinP(p=1.0), count=400)) == {0, 1, 2, 3}


def test_top_k_top_p_applies_both_filters(logits: torch.Tensor) -> None:
    k_best = sorted(best(logits, 8))
    renormalised = torch.full_like(logits, float("-inf"))
    renormalised[k_best] = logits[k_best]
    allowed = nucleus(renormalised.softmax(-1), 0.6)
    assert allowed < best(logits, 8)
    assert set(drawn(logits, TopKTopP(k=8, p=0.6))) == allowed


def test_tiny_temperature_is_greedy(logits: torch.Tensor) -> None:
    top = int(logits.argmax())
    for op in (
        Multinomial(temperature=1e-4),
        TopP(temperature=1e-4, p=0.99),
        MinP(temperature=1e-4, p=0.01),
    ):
        assert set(drawn(logits, op, count=200)) == {top}


def test_multinomial_frequencies_follow_softmax() -> None:
    """20,000 draws: each frequency within 0.02 of softmax(logits / T) (about 6 sigma)."""
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    counts = torch.bincount(
        torch.tensor(drawn(row, Multinomial(temperature=0.7), 20_000)), minlength=6
    )
    expected = (row / 0.7).softmax(-1)
    torch.testing.assert_close(counts / 20_000, expected, atol=0.02, rtol=0)


def test_argmax_picks_the_best_of_each_row(logits: torch.Tensor) -> None:
    rows = torch.stack([logits, -logits, logits.roll(3)])
    outputs = read_slots(rows, [Argmax()] * 3, torch.Generator())
    assert outputs == [TokenOutput(token=int(r.argmax())) for r in rows]


SEEDED = [
    Multinomial(seed=11),
    TopK(k=6, seed=12),
    TopP(p=0.8, seed=13),
    MinP(p=0.05, seed=14),
    TopKTopP(k=10, p=0.9, seed=15),
]


@pytest.mark.parametrize("op", SEEDED, ids=lambda op: type(op).__name__)
def test_seeded_draw_is_independent_of_call_and_batch(logits: torch.Tensor, op: SlotOp) -> None:
    others = torch.randn(5, VOCAB)
    alone = read_slots(logits[None], [op], torch.Generator().manual_seed(0))
    again = read_slots(logits[None], [op], torch.Generator().manual_seed(99))
    ops_around: list[SlotOp] = [Multinomial(), op, TopK(k=3), Argmax(), Multinomial(), op]
    rows = torch.cat([others[:1], logits[None], others[1:4], logits[None]])
    batched = read_slots(rows, ops_around, torch.Generator().manual_seed(5))
    assert alone == again == [batched[1]] == [batched[5]]


def test_unseeded_draws_follow_the_generator_they_are_given(logits: torch.Tensor) -> None:
    rows = logits.expand(50, -1)
    ops: list[SlotOp] = [Multinomial(), TopK(k=8)] * 25
    first = read_slots(rows, ops, torch.Generator().manual_seed(3))
    second = read_slots(rows, ops, torch.Generator().manual_seed(3))
    assert first == second


def test_different_seeds_give_different_draws(logits: torch.Tensor) -> None:
    tokens = {drawn(logits, Multinomial(seed=s), count=1)[0] for s in range(40)}
    assert len(tokens) > 3


ALL_SAMPLERS = [
    Argmax(),
    Multinomial(),
    TopK(k=10),
    TopP(p=0.95),
    MinP(p=0.01),
    TopKTopP(k=12, p=0.95),
    Multinomial(seed=3),
]


@pytest.mark.parametrize("op", ALL_SAMPLERS, ids=lambda op: type(op).__name__)
def test_logit_mask_is_respected_by_every_sampler(logits: torch.Tensor, op: SlotOp) -> None:
    allowed = torch.ones(VOCAB, dtype=torch.bool)
    allowed[sorted(best(logits, 6))] = False
    count = 1000
    outputs = read_slots(
        logits.expand(count, -1), [op] * count, torch.Generator(), allowed.expand(count, -1)
    )
    drawn_tokens = {out.token for out in outputs if isinstance(out, TokenOutput)}
    assert len(drawn_tokens) >= 1
    assert all(allowed[t] for t in drawn_tokens)


def test_probes_match_torch(logits: torch.Tensor) -> None:
    ops: list[SlotOp] = [
        Distribution(k=4, temperature=0.5),
        RawLogits(),
        LogProbs(tokens=(0, 5, 23)),
        Entropy(),
    ]
    dist, raw, logprobs, entropy = read_slots(logits.expand(4, -1), ops, torch.Generator())
    top = (logits / 0.5).softmax(-1).topk(4)
    assert isinstance(dist, DistributionOutput)
    assert dist.tokens == tuple(top.indices.tolist())
    assert dist.probs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert raw == LogitsOutput(values=tuple(logits.tolist()))
    assert isinstance(logprobs, LogProbsOutput)
    assert logprobs.values == pytest.approx(logits.log_softmax(-1)[[0, 5, 23]].tolist(), abs=1e-6)
    probs = logits.double().softmax(-1)
    assert isinstance(entropy, EntropyOutput)
    assert entropy.value == pytest.approx(float(-(probs * probs.log()).sum()), abs=1e-5)


def test_probes_see_the_logit_mask(logits: torch.Tensor) -> None:
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[2, 9]] = True
    ops: list[SlotOp] = [RawLogits(), Entropy(), LogProbs(tokens=(2, 3)), Distribution(k=3)]
    raw, entropy, logprobs, dist = read_slots(
        logits.expand(4, -1), ops, torch.Generator(), allowed.expand(4, -1)
    )
    assert isinstance(raw, LogitsOutput)
    assert [v for v in raw.values if v != -math.inf] == logits[[2, 9]].tolist()
    two = logits[[2, 9]].softmax(-1)
    assert isinstance(entropy, EntropyOutput)
    assert entropy.value == pytest.approx(float(-(two * two.log()).sum()), abs=1e-6)
    assert isinstance(logprobs, LogProbsOutput)
    assert logprobs.values[0] == pytest.approx(float(two[0].log()), abs=1e-6)
    assert logprobs.values[1] == -math.inf
    assert isinstance(dist, DistributionOutput)
    assert set(dist.tokens[:2]) == {2, 9} and dist.probs[2] == 0.0


def test_outputs_follow_slot_order(logits: torch.Tensor) -> None:
    ops: list[SlotOp] = [Entropy(), Argmax(), TopK(k=2), RawLogits(), Argmax()]
    outputs = read_slots(logits.expand(5, -1), ops, torch.Generator())
    kinds = [type(out) for out in outputs]
    assert kinds == [EntropyOutput, TokenOutput, TokenOutput, LogitsOutput, TokenOutput]
