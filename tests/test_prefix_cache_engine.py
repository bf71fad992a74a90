"""Prefix caching through the whole engine: a repeated prompt reaches the driver only from its
last page on and gives the same outputs, on the synthetic driver and on the real default model;
snapshots feed it; the config's scope and the launching user decide who shares."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.actors.generate import generate, prompt_ids
from pie.config import ConfigError, EngineConfig, config_from_dict, with_overrides
from pie.drivers.batch import ForwardBatch
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import Engine, open_engine
from pie.events.sampling import Argmax, Distribution, DistributionOutput, SamplingSlot, SlotOutput
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

PAGE = 16
PROMPT = list(range(100, 137))
"""Two full pages of 16 tokens and five more."""


def scoped(scope: str) -> EngineConfig:
    return with_overrides(EngineConfig(), kv={"prefix_cache": scope})


def last_slot(n: int) -> tuple[SamplingSlot, ...]:
    return (SamplingSlot(index=n - 1, op=Argmax()),)


class CountingDriver:
    """A driver that remembers how many tokens each pass it ran held."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.info = inner.info
        self.sizes: list[int] = []

    def forward(self, batch: ForwardBatch) -> list[SlotOutput]:
        self.sizes.append(batch.num_tokens)
        result: list[SlotOutput] = self.inner.forward(batch)
        return result

    def prefills(self) -> list[int]:
        """The sizes of the passes since the last call that held more than one token."""
        sizes, self.sizes = self.sizes, []
        return [n for n in sizes if n > 1]


async def prompt_twice(engine: Engine, users: tuple[str, str]) -> list[list[int]]:
    """The tokens each of two contexts of `users` sent to the driver for the same prompt."""
    driver = engine.driver
    assert isinstance(driver, SyntheticDriver)
    seen = []
    async with engine.requester() as req:
        for user in users:
            context = await req.create_context(user=user)
            before = len(driver.batches)
            await req.forward(context, PROMPT, last_slot(len(PROMPT)))
            seen.append([t for b in driver.batches[before:] for t in b.token_ids])
    return seen


@pytest.mark.unit
def test_the_config_names_a_scope_and_defaults_to_per_user() -> None:
    assert EngineConfig().kv.prefix_cache == "user"
    assert config_from_dict({"kv": {"prefix_cache": "global"}}).kv.prefix_cache == "global"
    with pytest.raises(ConfigError, match="prefix_cache must be one of off, user, global"):
        config_from_dict({"kv": {"prefix_cache": "team"}})


@pytest.mark.integration
async def test_a_repeated_prompt_reaches_the_driver_from_its_last_page_on() -> None:
    driver = SyntheticDriver(page_size=PAGE)
    with trio.fail_after(10):
        async with open_engine(driver=driver) as engine:
            async with engine.requester() as req:
                outputs = []
                for _ in range(2):
                    context = await req.create_context()
                    outputs.append(await req.forward(context, PROMPT, last_slot(len(PROMPT))))
                    await req.destroy(context)
            stats = engine.statistics().kv
    first, second = driver.batches[-2:]
    assert (first.token_ids, second.token_ids) == (PROMPT, PROMPT[32:])
    assert outputs[0] == outputs[1]
    assert (stats.prefix_hits, stats.prefix_hit_pages, stats.prefix_hit_tokens) == (1, 2, 32)
    assert stats.pages_free == stats.pages_total and stats.pages_cached == 2


@pytest.mark.integration
async def test_a_snapshot_feeds_a_new_context_with_the_same_prompt() -> None:
    driver = SyntheticDriver(page_size=PAGE)
    with trio.fail_after(10):
        async with open_engine(driver=driver) as engine:
            async with engine.requester() as req:
                saved = await req.create_context()
                await req.forward(saved, PROMPT[:32])
                await req.save(saved, "preamble")
                await req.destroy(saved)
                fresh = await req.create_context()
                await req.forward(fresh, PROMPT, last_slot(len(PROMPT)))
                assert (await req.describe(fresh)).tokens == tuple(PROMPT)
            stats = engine.statistics().kv
    assert driver.batches[-1].token_ids == PROMPT[32:]
    assert (stats.prefix_hit_tokens, stats.snapshots) == (32, 1)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("scope", "users", "computed"),
    [
        ("user", ("ann", "bob"), [37, 37]),
        ("user", ("ann", "ann"), [37, 5]),
        ("global", ("ann", "bob"), [37, 5]),
        ("off", ("ann", "ann"), [37, 37]),
    ],
)
async def test_the_scope_decides_whose_prompts_are_reused(
    scope: str, users: tuple[str, str], computed: list[int]
) -> None:
    with trio.fail_after(10):
        async with open_engine(scoped(scope), driver=SyntheticDriver(page_size=PAGE)) as engine:
            seen = await prompt_twice(engine, users)
    assert [len(tokens) for tokens in seen] == computed
    assert all(tokens == PROMPT[37 - len(tokens) :] for tokens in seen)


@pytest.fixture(scope="module")
def relay(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "relay").read_bytes()


@pytest.mark.integration
async def test_inferlets_share_prompts_only_with_their_own_users_contexts(
    relay: bytes,
    default_model_dir: Path,  # noqa: F811
) -> None:
    tokenizer = Tokenizer.from_folder(default_model_dir)
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size, page_size=PAGE)
    text = "a prompt long enough to fill a few pages of sixteen tokens " * 4
    computed = []
    with trio.fail_after(60):
        async with open_engine(driver=driver, tokenizer=tokenizer) as engine:
            program = engine.programs.add(relay).hash
            for n, user in enumerate(("ann", "bob", "ann")):
                before = len(driver.batches)
                request = json.dumps({"mode": "save", "text": text, "name": f"s{n}"})
                outcome = await engine.run_inferlet(program, request, user=user)
                assert outcome.status == "returned", outcome.error
                computed.append(sum(b.num_tokens for b in driver.batches[before:]))
    length = int(outcome.result or 0)
    assert length > 2 * PAGE
    assert computed == [length, length, length % PAGE or PAGE]


@pytest.mark.model
async def test_a_repeated_long_prompt_prefills_only_its_last_partial_page(real: Any) -> None:
    config, driver, tokenizer = real
    counting = CountingDriver(driver)
    story = "Tell me a long story about a lighthouse keeper and the ships she guided home. " * 11
    ids = prompt_ids(tokenizer, story)
    assert len(ids) > 200 and len(ids) % PAGE > 1
    generations = []
    prefills = []
    async with open_engine(config, driver=counting, tokenizer=tokenizer) as engine:
        async with engine.requester() as req:
            for _ in range(2):
                generations.append(await generate(req, ids, max_tokens=24, sampler=Argmax()))
                prefills.append(counting.prefills())
        stats = engine.statistics().kv
    assert prefills == [[len(ids)], [len(ids) % PAGE]]
    assert generations[0].tokens == generations[1].tokens
    reused = len(ids) - len(ids) % PAGE
    assert (stats.prefix_hits, stats.prefix_hit_tokens) == (1, reused)
    assert stats.pages_free == stats.pages_total


@pytest.mark.model
async def test_the_distribution_after_a_reused_prompt_is_the_computed_one(real: Any) -> None:
    config, driver, tokenizer = real
    ids = prompt_ids(tokenizer, "Name three rivers of Europe and say where each one ends. " * 4)
    probe = (SamplingSlot(index=len(ids) - 1, op=Distribution(k=20)),)
    outputs = []
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        async with engine.requester() as req:
            for _ in range(2):
                context = await req.create_context()
                [out] = await req.forward(context, ids, probe)
                assert isinstance(out, DistributionOutput)
                outputs.append(out)
        assert engine.statistics().kv.prefix_hits == 1
    assert outputs[0].tokens == outputs[1].tokens
    assert outputs[0].probs == pytest.approx(outputs[1].probs, abs=1e-5)
