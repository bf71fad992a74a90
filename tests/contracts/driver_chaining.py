"""The contract of a driver that launches passes without waiting for them (`launch`, then
`collect`): a pass launched before the last one is collected runs after it, and its chained
tokens are what that pass sampled, as if the host had fed them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pie.drivers.base import DriverError
from pie.drivers.batch import ForwardBatch
from pie.events.forward import ForwardRequest
from pie.events.sampling import Argmax, RawLogits, SlotOutput
from tests.contracts.passes import (
    DriverRunner,
    NewDriver,
    PageSupply,
    assert_close,
    logits_of,
    prompt,
    request,
    token_of,
)

STEPS = 3


def _launcher(new_driver: NewDriver) -> Any:
    driver = new_driver()
    if not hasattr(driver, "launch"):
        pytest.skip(f"{type(driver).__name__} runs each pass to its end (no launch)")
    return driver


def _batch(requests: Sequence[ForwardRequest], chained: Sequence[tuple[int, int]]) -> ForwardBatch:
    batch = ForwardBatch.from_requests(requests)
    batch.chained = list(chained)
    return batch


class ChainingContract(DriverRunner):
    def _contexts(self, driver: Any) -> list[tuple[list[int], tuple[int, ...]]]:
        supply = PageSupply(driver.info, seed=41)
        info = driver.info
        return [
            (prompt(info, 5 + i, seed=40 + i), supply.for_tokens(5 + i + STEPS)) for i in range(3)
        ]

    def _steps(self, driver: Any, chain: bool) -> list[list[SlotOutput]]:
        """Three contexts prefilled, then STEPS greedy decodes of the first two, the third
        prefilled late beside the first decode (a mixed pass, then graph-sized ones). Chained:
        each pass is launched before the last is collected and reads its tokens on the
        device; else each token comes back to the host and is fed from there."""
        contexts = self._contexts(driver)
        ops = (Argmax(), RawLogits())
        first = [request(0, tokens, pages, ops) for tokens, pages in contexts[:2]]
        passes: list[list[SlotOutput]] = []
        launched = driver.launch(_batch(first, ()))
        if not chain:
            passes.append(driver.collect(launched))
        for step in range(STEPS):
            decodes = []
            chained = []
            for c, (tokens, pages) in enumerate(contexts[:2]):
                fed = 0 if chain else token_of(passes[-1][2 * c])
                if chain:
                    chained.append((c, 2 * c))
                decodes.append(request(len(tokens) + step, [fed], pages, ops))
            if step == 0:
                tokens, pages = contexts[2]
                decodes.append(request(0, tokens, pages, ops))
            following = driver.launch(_batch(decodes, chained), after=launched if chain else None)
            if chain:
                passes.append(driver.collect(launched))
                launched = following
            else:
                passes.append(driver.collect(following))
        if chain:
            passes.append(driver.collect(launched))
        return passes

    def test_chained_passes_give_what_passes_fed_from_the_host_give(
        self, new_driver: NewDriver
    ) -> None:
        fed = self._steps(_launcher(new_driver), chain=False)
        chained = self._steps(_launcher(new_driver), chain=True)
        assert len(fed) == len(chained) == STEPS + 1
        for got, want in zip(chained, fed, strict=True):
            assert len(got) == len(want)
            for slot in range(0, len(want), 2):
                assert token_of(got[slot]) == token_of(want[slot])
                assert_close(
                    logits_of(got[slot + 1]), logits_of(want[slot + 1]), self.logit_tolerance
                )

    def test_a_chained_token_must_name_a_slot_its_pass_sampled(self, new_driver: NewDriver) -> None:
        driver = _launcher(new_driver)
        (tokens, pages), *_ = self._contexts(driver)
        decode = request(len(tokens), [0], pages, (Argmax(),))
        with pytest.raises(DriverError, match="chained"):
            driver.launch(_batch([decode], [(0, 0)]))  # no pass to read from
        prefill = request(0, tokens, pages, (RawLogits(),))
        probed = driver.launch(_batch([prefill], ()))
        driver.collect(probed)
        for chained in ([(0, 0)], [(0, 5)], [(3, 0)]):  # a probe, no such slot, no such token
            with pytest.raises(DriverError, match="chained"):
                driver.launch(_batch([decode], chained), after=probed)
        # After the refusals, a chained decode reads the token its pass before sampled.
        greedy = request(0, tokens, pages, (Argmax(),))
        sampled = driver.launch(_batch([greedy], ()))
        token = token_of(driver.collect(sampled)[0])
        # Another pass launched in between does not change which pass a chain reads.
        driver.collect(driver.launch(_batch([prefill], ())))
        got = driver.collect(driver.launch(_batch([decode], [(0, 0)]), after=sampled))
        fresh = _launcher(new_driver)
        fresh.collect(fresh.launch(_batch([greedy], ())))
        fed = request(len(tokens), [token], pages, (Argmax(),))
        want = fresh.collect(fresh.launch(_batch([fed], ())))
        assert token_of(got[0]) == token_of(want[0])
