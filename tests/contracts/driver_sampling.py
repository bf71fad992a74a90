"""The sampling half of the driver contract: every sampler's draws, seeds and temperatures, logit
masks, and probes, read at one context position through `forward`."""

from __future__ import annotations

import math

import pytest
import torch

from pie.drivers.base import Driver
from pie.events.sampling import (
    Argmax,
    Distribution,
    Entropy,
    LogitBias,
    LogProbs,
    MinP,
    Multinomial,
    Penalty,
    RawLogits,
    SlotOp,
    TopK,
    TopKTopP,
    TopP,
    bools_to_rle,
)
from tests.contracts.passes import (
    PROBE_TOLERANCE,
    DriverRunner,
    NewDriver,
    PageSupply,
    allowed_by,
    assert_close,
    distribution_of,
    entropy,
    entropy_of,
    logits_of,
    logprobs_of,
    op_name,
    prompt,
    request,
    run,
    token_of,
    tokens_of,
)

FREQUENCY_TOLERANCE = 0.05
"""For 2,000 draws: 4.5 standard deviations of a frequency near 0.5."""

DRAWS: tuple[SlotOp, ...] = (
    Multinomial(temperature=1.3),
    TopK(k=4, temperature=0.8),
    TopP(p=0.6, temperature=1.2),
    MinP(p=0.2, temperature=0.9),
    TopKTopP(k=6, p=0.7, temperature=1.1),
)
SEEDED: tuple[SlotOp, ...] = (
    Multinomial(temperature=1.3, seed=11),
    TopK(k=4, temperature=0.8, seed=12),
    TopP(p=0.6, seed=13),
    MinP(p=0.2, seed=14),
    TopKTopP(k=6, p=0.7, seed=15),
)
COLD: tuple[SlotOp, ...] = (
    Multinomial(temperature=1e-4),
    TopK(k=5, temperature=1e-4),
    TopP(p=0.9, temperature=1e-4),
    MinP(p=0.05, temperature=1e-4),
    TopKTopP(k=5, p=0.9, temperature=1e-4),
)


class SamplingContract(DriverRunner):
    """Samplers, logit masks and probes; part of DriverContract, which documents the runner."""

    # -- samplers ----------------------------------------------------------------------------

    def _sampling_context(self, driver: Driver) -> tuple[int, tuple[int, ...], list[int]]:
        """(kv_start, pages, tokens) of a context whose last token the sampler tests read."""
        n = driver.info.page_size + 3
        tokens = prompt(driver.info, n, seed=11)
        pages = PageSupply(driver.info, seed=11).for_tokens(n)
        run(driver, request(0, tokens[:-1], pages, ()))
        return n - 1, pages, tokens[-1:]

    def test_argmax_is_the_top_raw_logit(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        raw, token, dist = run(
            driver, request(start, last, pages, (RawLogits(), Argmax(), Distribution(k=2)))
        )
        assert token_of(token) == int(logits_of(raw).argmax())
        assert distribution_of(dist).tokens[0] == token_of(token)

    @pytest.mark.parametrize("op", DRAWS, ids=op_name)
    def test_draws_stay_inside_the_samplers_allowed_set(
        self, new_driver: NewDriver, op: SlotOp
    ) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        raw, *draws = run(driver, request(start, last, pages, (RawLogits(), *[op] * 200)))
        allowed = allowed_by(op, logits_of(raw))
        drawn = set(tokens_of(draws))
        assert drawn <= allowed
        if self.computes_model:
            assert len(drawn) >= 2, "a spread distribution gives more than one token"
            if not isinstance(op, Multinomial):
                assert len(allowed) < driver.info.vocab_size, "the filter removes tokens"
        else:
            assert drawn == {int(logits_of(raw).argmax())}

    @pytest.mark.parametrize("op", SEEDED, ids=op_name)
    def test_seeded_draws_repeat_whatever_the_pass_around_them(
        self, new_driver: NewDriver, op: SlotOp
    ) -> None:
        first, second = new_driver(), new_driver()
        start, pages, last = self._sampling_context(first)
        [alone] = run(first, request(start, last, pages, (op,)))
        [again] = run(first, request(start, last, pages, (op,)))
        start, pages, last = self._sampling_context(second)
        other = PageSupply(second.info, seed=12).take(1)
        around = run(
            second,
            request(0, [3, 1], other, (Multinomial(), TopK(k=2, seed=99))),
            request(start, last, pages, (Argmax(), op, Multinomial(), op)),
        )
        assert token_of(alone) == token_of(again)
        assert token_of(around[3]) == token_of(around[5])
        if self.batch_invariant_tokens:
            assert token_of(alone) == token_of(around[3])

    def test_distinct_seeds_draw_distinct_tokens(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        seeds = [Multinomial(temperature=1.3, seed=s) for s in range(32)]
        raw, *draws = run(driver, request(start, last, pages, (RawLogits(), *seeds)))
        if self.computes_model:
            assert len(set(tokens_of(draws))) >= 3
        else:
            assert set(tokens_of(draws)) == {int(logits_of(raw).argmax())}

    def test_draw_frequencies_follow_the_distribution_probe(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        ops: list[SlotOp] = [Distribution(k=5, temperature=1.3)]
        ops += [Multinomial(temperature=1.3)] * 2000
        dist, *draws = run(driver, request(start, last, pages, ops))
        counts = torch.bincount(torch.tensor(tokens_of(draws)), minlength=driver.info.vocab_size)
        top = distribution_of(dist)
        frequencies = (counts[list(top.tokens)] / len(draws)).double()
        probs = torch.tensor(top.probs, dtype=torch.float64)
        assert (frequencies - probs).abs().max().item() <= FREQUENCY_TOLERANCE

    def test_a_cold_temperature_draws_the_argmax(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        ops = (RawLogits(), Argmax(), *COLD)
        raw, argmax, *cold = run(driver, request(start, last, pages, ops))
        top2 = logits_of(raw).topk(2).values
        assert (top2[0] - top2[1]).item() > 1e-2, "the top two logits are too close to tell"
        assert set(tokens_of(cold)) == {token_of(argmax)}

    # -- logit masks -------------------------------------------------------------------------

    def _logit_mask(self, driver: Driver, raw: torch.Tensor) -> list[bool]:
        """Every third token and the three most likely ones are not allowed."""
        allowed = [i % 3 != 0 for i in range(driver.info.vocab_size)]
        for token in raw.topk(3).indices.tolist():
            allowed[token] = False
        return allowed

    @pytest.mark.parametrize("op", (Argmax(), *DRAWS, SEEDED[0]), ids=op_name)
    def test_a_logit_mask_bounds_every_sampler(self, new_driver: NewDriver, op: SlotOp) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        [unmasked] = run(driver, request(start, last, pages))
        allowed = self._logit_mask(driver, logits_of(unmasked))
        mask = bools_to_rle(allowed)
        raw, *draws = run(
            driver, request(start, last, pages, (RawLogits(), *[op] * 100), logit_mask=mask)
        )
        drawn = set(tokens_of(draws))
        assert all(allowed[t] for t in drawn)
        assert drawn <= allowed_by(op, logits_of(raw))

    def test_a_logit_mask_reaches_every_probe(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        [unmasked] = run(driver, request(start, last, pages))
        plain = logits_of(unmasked)
        allowed = self._logit_mask(driver, plain)
        asked = (allowed.index(False), allowed.index(True))
        ops = (RawLogits(), Distribution(k=8), LogProbs(tokens=asked), Entropy())
        raw_out, dist_out, logprobs_out, entropy_out = run(
            driver, request(start, last, pages, ops, logit_mask=bools_to_rle(allowed))
        )
        raw, value = logits_of(raw_out), entropy_of(entropy_out)
        assert_close(
            raw, plain.masked_fill(~torch.tensor(allowed), float("-inf")), self.logit_tolerance
        )
        top = distribution_of(dist_out)
        assert all(allowed[t] or p == 0.0 for t, p in zip(top.tokens, top.probs, strict=True))
        banned, shown = logprobs_of(logprobs_out)
        assert banned == float("-inf") and shown <= PROBE_TOLERANCE
        assert value <= math.log(sum(allowed)) + PROBE_TOLERANCE
        if self.computes_model:
            assert abs(shown - raw.log_softmax(-1)[asked[1]].item()) <= PROBE_TOLERANCE
            assert abs(value - entropy(raw)) <= PROBE_TOLERANCE

    def test_a_logit_bias_shifts_the_logits_before_the_mask_and_the_samplers(
        self, new_driver: NewDriver
    ) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        [unbiased] = run(driver, request(start, last, pages))
        plain = logits_of(unbiased)
        vocab = driver.info.vocab_size
        low = plain.argsort()[: vocab // 2].tolist()  # the less likely half
        boosted = [i in set(low) for i in range(vocab)]
        favourite = int(plain.argmax())
        allowed = [i != low[0] for i in range(vocab)]  # the mask still wins over the bias
        biases = (
            LogitBias(mask=bools_to_rle(boosted), value=60.0),
            LogitBias(mask=bools_to_rle([i == favourite for i in range(vocab)]), value=-5.0),
        )
        raw_out, argmax_out = run(
            driver,
            request(
                start,
                last,
                pages,
                (RawLogits(), Argmax()),
                logit_bias=biases,
                logit_mask=bools_to_rle(allowed),
            ),
        )
        expected = plain + 60.0 * torch.tensor(boosted, dtype=plain.dtype)
        expected[favourite] -= 5.0
        expected = expected.masked_fill(~torch.tensor(allowed), float("-inf"))
        assert_close(logits_of(raw_out), expected, self.logit_tolerance)
        chosen = token_of(argmax_out)
        assert boosted[chosen] and allowed[chosen]

    def test_penalties_take_counted_tokens_down_after_the_biases(
        self, new_driver: NewDriver
    ) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        [unpenalised] = run(driver, request(start, last, pages))
        plain = logits_of(unpenalised)
        vocab = driver.info.vocab_size
        favourite, second = plain.argsort(descending=True)[:2].tolist()
        counted = (favourite, favourite, favourite, second)
        raw_out, argmax_out = run(
            driver,
            request(
                start,
                last,
                pages,
                (RawLogits(), Argmax()),
                logit_bias=(LogitBias(mask=bools_to_rle([True] * vocab), value=1.0),),
                penalty=Penalty(presence=0.5, frequency=40.0, tokens=counted),
            ),
        )
        expected = plain + 1.0
        expected[favourite] -= 3 * 40.0 + 0.5
        expected[second] -= 40.0 + 0.5
        assert_close(logits_of(raw_out), expected, self.logit_tolerance)
        assert token_of(argmax_out) not in (favourite, second)

    # -- probes ------------------------------------------------------------------------------

    def test_probes_agree_with_the_raw_logits(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        start, pages, last = self._sampling_context(driver)
        [first] = run(driver, request(start, last, pages))
        ranked = logits_of(first).argsort(descending=True).tolist()
        asked = (ranked[0], ranked[-1], ranked[len(ranked) // 2])
        ops = (RawLogits(), Distribution(k=5, temperature=0.7), LogProbs(tokens=asked), Entropy())
        raw_out, dist_out, logprobs_out, entropy_out = run(driver, request(start, last, pages, ops))
        raw, dist = logits_of(raw_out), distribution_of(dist_out)
        logprobs, value = torch.tensor(logprobs_of(logprobs_out)), entropy_of(entropy_out)
        assert dist.tokens[0] == ranked[0] and len(set(dist.tokens)) == len(dist.tokens) <= 5
        assert list(dist.probs) == sorted(dist.probs, reverse=True)
        assert 0.0 <= min(dist.probs) and sum(dist.probs) <= 1.0 + PROBE_TOLERANCE
        assert (logprobs <= PROBE_TOLERANCE).all() and logprobs.argmax().item() == 0
        assert -PROBE_TOLERANCE <= value <= math.log(raw.numel()) + PROBE_TOLERANCE
        if self.computes_model:
            probs = (raw / 0.7).softmax(-1)
            # The five most likely tokens, each with its own probability (which of two tokens
            # with equal logits comes first is the driver's choice: bfloat16 logits often tie).
            assert_close(torch.tensor(dist.probs), probs.topk(5).values, PROBE_TOLERANCE)
            assert_close(probs[list(dist.tokens)], torch.tensor(dist.probs), PROBE_TOLERANCE)
            assert_close(logprobs, raw.log_softmax(-1)[list(asked)], PROBE_TOLERANCE)
            assert abs(value - entropy(raw)) <= PROBE_TOLERANCE
