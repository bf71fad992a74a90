"""The contract every Driver passes: samplers, probes, masks, page tables, mixed batches and the
batches it must refuse, checked through `forward` alone against a reference the runner gives."""

from __future__ import annotations

import pytest
import torch

from pie.drivers.base import DriverError, DriverInfo
from pie.drivers.batch import ForwardBatch
from pie.events.forward import PageCopy
from pie.events.sampling import (
    PROBES,
    SAMPLERS,
    Argmax,
    Distribution,
    Entropy,
    LogProbs,
    Multinomial,
    RawLogits,
    SamplingSlot,
    SlotOp,
    SlotOutput,
    TopKTopP,
    bools_to_rle,
)
from tests.contracts.driver_sampling import SamplingContract
from tests.contracts.passes import (
    EVERY_OP,
    PROBE_TOLERANCE,
    REFUSALS,
    NewDriver,
    PageSupply,
    Reference,
    assert_close,
    distribution_of,
    entropy_of,
    every_token,
    logits_of,
    logprobs_of,
    prompt,
    request,
    run,
    token_of,
)


class DriverContract(SamplingContract):
    """What every Driver does, observed through `info` and `forward` only.

    A driver runs it with a test class that subclasses this one and provides:

    - `new_driver`, a fixture returning a factory of drivers that share one model and start with
      empty KV pages, with at least 64 pages and room for 4 * page_size + 8 tokens and 5
      requests in a pass;
    - `reference_logits`, a fixture returning a function from one sequence (positions 0..T-1)
      to its logits [T, vocab] computed without pages (transformers, a dense attention, or the
      synthetic driver's rule);
    - the attributes of DriverRunner: `computes_model`, `reference_tolerance`,
      `logit_tolerance` and `batch_invariant_tokens`, which say what the driver guarantees.

    Everything is checked through the outputs `forward` returns, so nothing depends on where
    the driver keeps its tensors: the same driver on another device is a subclass of its runner
    that sets the runner's `device` (see TestTorchDriver in tests/test_driver_contract.py).
    """

    # -- outputs -----------------------------------------------------------------------------

    def test_the_contract_exercises_every_op_there_is(self) -> None:
        assert {type(op) for op in EVERY_OP} == {*SAMPLERS, *PROBES}

    def test_info_states_usable_limits(self, new_driver: NewDriver) -> None:
        info = new_driver().info
        assert info.vocab_size >= 2 and info.page_size >= 1 and info.num_pages >= 1
        assert info.max_batch_tokens >= 1 and info.max_batch_requests >= 1

    def test_one_output_per_slot_in_slot_order(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        info = driver.info
        tokens = prompt(info, 7, seed=1)
        slots = tuple(SamplingSlot(index=i % 7, op=op) for i, op in enumerate(EVERY_OP[::-1]))
        pages = PageSupply(info).for_tokens(7)
        outputs = run(driver, request(0, tokens, pages, slots=slots))
        assert len(outputs) == len(EVERY_OP)
        for slot, out in zip(slots, outputs, strict=True):
            if isinstance(slot.op, SAMPLERS):
                assert 0 <= token_of(out) < info.vocab_size
            elif isinstance(slot.op, RawLogits):
                assert len(logits_of(out)) == info.vocab_size
            elif isinstance(slot.op, LogProbs):
                assert len(logprobs_of(out)) == len(slot.op.tokens)
            elif isinstance(slot.op, Distribution):
                assert 1 <= len(distribution_of(out).tokens) <= slot.op.k
            else:
                assert entropy_of(out) >= 0.0

    def test_a_pass_without_slots_returns_nothing_but_writes_its_kv(
        self, new_driver: NewDriver, reference_logits: Reference
    ) -> None:
        driver = new_driver()
        tokens = prompt(driver.info, 9, seed=2)
        pages = PageSupply(driver.info).for_tokens(10)
        assert run(driver, request(0, tokens[:-1], pages, ())) == []
        [last] = run(driver, request(8, tokens[-1:], pages))
        assert_close(logits_of(last), reference_logits(tokens)[-1], self.reference_tolerance)

    # -- page tables -------------------------------------------------------------------------

    def test_logits_at_every_token_of_a_prompt_match_the_reference(
        self, new_driver: NewDriver, reference_logits: Reference
    ) -> None:
        driver = new_driver()
        n = 2 * driver.info.page_size + 3
        tokens = prompt(driver.info, n, seed=3)
        pages = PageSupply(driver.info).for_tokens(n)
        outputs = run(driver, request(0, tokens, pages, slots=every_token(n)))
        reference = reference_logits(tokens)
        for i, out in enumerate(outputs):
            assert_close(logits_of(out), reference[i], self.reference_tolerance)

    def test_kv_written_in_one_pass_is_read_by_later_ones(
        self, new_driver: NewDriver, reference_logits: Reference
    ) -> None:
        driver = new_driver()
        page = driver.info.page_size
        chunks = [page + 1, page - 1, 1, 1, 2]
        tokens = prompt(driver.info, sum(chunks), seed=4)
        pages = PageSupply(driver.info, seed=4).for_tokens(len(tokens))
        reference = reference_logits(tokens)
        done = 0
        for n in chunks:
            [out] = run(driver, request(done, tokens[done : done + n], pages))
            done += n
            assert_close(logits_of(out), reference[done - 1], self.reference_tolerance)

    def test_contexts_share_a_full_prefix_page(
        self, new_driver: NewDriver, reference_logits: Reference
    ) -> None:
        driver = new_driver()
        page = driver.info.page_size
        supply = PageSupply(driver.info, seed=5)
        prefix, mine, theirs = (prompt(driver.info, n, seed=50 + n) for n in (page, 3, 4))
        shared = supply.take(1)
        a_pages, b_pages = shared + supply.take(1), shared + supply.take(2)
        run(driver, request(0, prefix + mine[:-1], a_pages, ()))
        a, b = run(
            driver,
            request(page + 2, mine[-1:], a_pages),
            request(page, theirs, b_pages),
        )
        assert_close(logits_of(a), reference_logits(prefix + mine)[-1], self.reference_tolerance)
        assert_close(logits_of(b), reference_logits(prefix + theirs)[-1], self.reference_tolerance)

    def test_a_page_copy_forks_a_partial_tail_before_the_pass_writes(
        self, new_driver: NewDriver, reference_logits: Reference
    ) -> None:
        driver = new_driver()
        page = driver.info.page_size
        supply = PageSupply(driver.info, seed=6)
        prefix = prompt(driver.info, page + 2, seed=6)
        x, y, z, w = prompt(driver.info, 4, seed=60)
        head, tail, fresh = supply.take(3)
        run(driver, request(0, prefix, (head, tail), ()))
        original, fork = run(
            driver,
            request(page + 2, [x], (head, tail)),
            request(page + 2, [y], (head, fresh), copies=(PageCopy(src=tail, dst=fresh),)),
        )
        later_original, later_fork = run(
            driver, request(page + 3, [w], (head, tail)), request(page + 3, [z], (head, fresh))
        )
        tol = self.reference_tolerance
        assert_close(logits_of(original), reference_logits([*prefix, x])[-1], tol)
        assert_close(logits_of(fork), reference_logits([*prefix, y])[-1], tol)
        assert_close(logits_of(later_original), reference_logits([*prefix, x, w])[-1], tol)
        assert_close(logits_of(later_fork), reference_logits([*prefix, y, z])[-1], tol)

    # -- mixed batches -----------------------------------------------------------------------

    def test_a_batch_mixing_prefills_and_decodes_matches_each_context_alone(
        self, new_driver: NewDriver
    ) -> None:
        together, alone = new_driver(), new_driver()
        info = together.info
        page = info.page_size
        ops: list[SlotOp] = [
            RawLogits(),
            Argmax(),
            Multinomial(seed=5),
            TopKTopP(k=5, p=0.9, seed=6),
            Distribution(k=3),
            LogProbs(tokens=(0, info.vocab_size - 1)),
            Entropy(),
        ]
        supply = PageSupply(info, seed=7)
        shapes = [(0, 2 * page + 1), (page + 2, 1), (2 * page + 2, 3), (3, 1)]
        warm, step = [], []
        for i, (done, n) in enumerate(shapes):
            tokens = prompt(info, done + n, seed=70 + i)
            pages = supply.for_tokens(done + n)
            if done:
                warm.append(request(0, tokens[:done], pages, ()))
            step.append(request(done, tokens[done:], pages, ops))
        run(together, *warm)
        batched = run(together, *step)
        for w in warm:
            run(alone, w)
        single = [out for s in step for out in run(alone, s)]
        assert len(batched) == len(single) == len(ops) * len(shapes)
        for op, got, want in zip(ops * len(shapes), batched, single, strict=True):
            self._assert_same_output(op, got, want, info)

    def _assert_same_output(
        self, op: SlotOp, got: SlotOutput, want: SlotOutput, info: DriverInfo
    ) -> None:
        tol = self.logit_tolerance
        match op:
            case RawLogits():
                assert_close(logits_of(got), logits_of(want), tol)
            case LogProbs():
                values = torch.tensor(logprobs_of(got)), torch.tensor(logprobs_of(want))
                assert_close(*values, tol + PROBE_TOLERANCE)
            case Entropy():
                assert abs(entropy_of(got) - entropy_of(want)) <= tol + PROBE_TOLERANCE
            case Distribution():
                top, expected = distribution_of(got), distribution_of(want)
                probs = torch.tensor(top.probs), torch.tensor(expected.probs)
                assert_close(*probs, tol + PROBE_TOLERANCE)
                assert top.tokens == expected.tokens or not self.batch_invariant_tokens
            case _ if self.batch_invariant_tokens:
                assert token_of(got) == token_of(want)
            case _:
                assert 0 <= token_of(got) < info.vocab_size

    # -- attention masks ---------------------------------------------------------------------

    def _hidden_slots_case(self, info: DriverInfo) -> tuple[list[int], set[int], list[int]]:
        page = info.page_size
        tokens = prompt(info, 2 * page + 2, seed=8)
        return tokens, {0, page, page + 1}, prompt(info, 2, seed=80)

    def test_slots_hidden_by_attention_masks_are_as_if_never_written(
        self, new_driver: NewDriver
    ) -> None:
        driver = new_driver()
        tokens, hidden, (x, y) = self._hidden_slots_case(driver.info)
        n = len(tokens)
        supply = PageSupply(driver.info, seed=8)
        shown = [j for j in range(n) if j not in hidden]
        over = [j not in hidden for j in range(n + 2)]
        masked_pages = supply.for_tokens(n + 2)
        masked_prefill = run(
            driver,
            request(
                0,
                tokens,
                masked_pages,
                slots=every_token(n),
                attention_masks=tuple(bools_to_rle(over[: t + 1]) for t in range(n)),
            ),
        )
        masked_step = run(
            driver,
            request(
                n,
                [x, y],
                masked_pages,
                slots=every_token(2),
                attention_masks=(bools_to_rle([*over[: n + 1], False]), bools_to_rle(over)),
            ),
        )
        short_pages = supply.for_tokens(len(shown) + 2)
        positions = (*shown, n, n + 1)
        kept = [tokens[j] for j in shown]
        short = run(
            driver,
            request(
                0,
                [*kept, x, y],
                short_pages,
                slots=every_token(len(shown) + 2),
                positions=positions,
            ),
        )
        compared = [masked_prefill[j] for j in shown] + masked_step
        for got, want in zip(compared, short, strict=True):
            assert_close(logits_of(got), logits_of(want), self.logit_tolerance)

    def test_masked_pages_are_as_if_never_written(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        page = driver.info.page_size
        tokens = prompt(driver.info, 3 * page, seed=9)
        [x] = prompt(driver.info, 1, seed=90)
        supply = PageSupply(driver.info, seed=9)
        pages = supply.for_tokens(3 * page + 1)
        run(driver, request(0, tokens, pages, (), masked_pages=(1,)))
        [masked] = run(driver, request(3 * page, [x], pages, masked_pages=(1,)))
        shown = [*range(page), *range(2 * page, 3 * page)]
        kept = [tokens[j] for j in shown] + [x]
        [short] = run(
            driver,
            request(0, kept, supply.for_tokens(len(kept)), positions=(*shown, 3 * page)),
        )
        assert_close(logits_of(masked), logits_of(short), self.logit_tolerance)

    def test_a_page_left_out_of_the_page_list_is_as_if_masked(self, new_driver: NewDriver) -> None:
        """What the kv actor sends once a context has released a page: the pages still held,
        the kv slots counted over them, the positions unchanged."""
        driver = new_driver()
        page = driver.info.page_size
        tokens = prompt(driver.info, 3 * page, seed=11)
        [x] = prompt(driver.info, 1, seed=110)
        pages = PageSupply(driver.info, seed=11).for_tokens(3 * page + 1)
        run(driver, request(0, tokens, pages, ()))
        [masked] = run(driver, request(3 * page, [x], pages, masked_pages=(1,)))
        held = (pages[0], *pages[2:])
        [left_out] = run(driver, request(2 * page, [x], held, positions=(3 * page,)))
        assert_close(logits_of(masked), logits_of(left_out), self.logit_tolerance)

    def test_attention_masks_change_what_a_real_model_sees(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        tokens, hidden, (x, _) = self._hidden_slots_case(driver.info)
        n = len(tokens)
        supply = PageSupply(driver.info, seed=10)
        pages = supply.for_tokens(n + 1)
        run(driver, request(0, tokens, pages, ()))
        mask = bools_to_rle([j not in hidden for j in range(n + 1)])
        [masked] = run(driver, request(n, [x], pages, attention_masks=(mask,)))
        [plain] = run(driver, request(n, [x], pages))
        difference = (logits_of(masked) - logits_of(plain)).abs().max().item()
        if self.computes_model:
            floor = self.mask_effect
            assert difference > (100 * self.logit_tolerance if floor is None else floor)
        else:
            assert difference <= self.logit_tolerance

    # -- refusals ----------------------------------------------------------------------------

    @pytest.mark.parametrize("case", REFUSALS)
    def test_a_refused_batch_raises_and_leaves_every_page_as_it_was(
        self, new_driver: NewDriver, reference_logits: Reference, case: str
    ) -> None:
        driver = new_driver()
        info = driver.info
        supply = PageSupply(info, seed=13)
        tokens = prompt(info, info.page_size + 2, seed=13)
        pages = supply.for_tokens(len(tokens) + 1)
        run(driver, request(0, tokens, pages, ()))
        other_tokens = prompt(info, len(tokens), seed=14)
        rewrite = request(0, other_tokens, pages, copies=(PageCopy(src=pages[1], dst=pages[0]),))
        batch = ForwardBatch.from_requests([rewrite])
        REFUSALS[case](batch, info, supply)
        with pytest.raises(DriverError):
            driver.forward(batch)
        [x] = prompt(info, 1, seed=15)
        [after] = run(driver, request(len(tokens), [x], pages))
        expected = reference_logits([*tokens, x])[-1]
        assert_close(logits_of(after), expected, self.reference_tolerance)

    def test_batches_at_the_limits_run(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        info = driver.info
        supply = PageSupply(info, seed=16)
        widest = prompt(info, info.max_batch_tokens, seed=16)
        assert len(run(driver, request(0, widest, supply.for_tokens(len(widest))))) == 1
        most = [request(0, [1], supply.take(1)) for _ in range(info.max_batch_requests)]
        assert len(run(driver, *most)) == info.max_batch_requests
