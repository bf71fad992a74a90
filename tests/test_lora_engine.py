"""LoRA adapters through the whole engine on a tiny random Llama: greedy generation through an
adapter equals peft's, alone and batched with other adapters and the base model, through the
requester API and through an inferlet (a run, a stepped generation, raw passes on the fast
path); the prefix cache never hands one adapter's KV to another; an unknown adapter is refused
and the next request served; a malformed folder stops the start; the server's status lists the
adapters, and the OpenAI server serves each as a model of its own."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import torch
import trio

from pie.actors.generate import generate
from pie.actors.requester import RequestRefused
from pie.config import EngineConfig, HttpConfig, ServerConfig, with_overrides
from pie.drivers.factory import build_torch_driver
from pie.engine import Engine, open_engine
from pie.events.sampling import Argmax, LogitsOutput, RawLogits, SamplingSlot
from pie.server.app import Server
from pie.server.http import HttpFront
from pie.server.mounts import OPENAI_PREFIX, OPENAI_SERVER, Mounts
from tests.inferlet_fixtures import GUESTS, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import components_dir
from tests.test_openai_server import client_for
from tests.tiny_adapters import ADAPTERS, peft_greedy, peft_logits, peft_model, save_tiny_adapters
from tests.tiny_models import TINY_TOLERANCE, save_tiny_model

pytestmark = pytest.mark.integration

PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [250, 11, 64, 64, 9, 30, 31], [8]]
CHOICES: list[str | None] = [None, *ADAPTERS]
TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny random Llama with its adapters, peft's greedy tokens for every prompt and
    adapter, and an engine config that loads the adapters."""
    root = tmp_path_factory.mktemp("lora-engine")
    base = save_tiny_model(root / "base", dict(model_type="llama"))
    folders = save_tiny_adapters(base, root)
    reference = peft_model(base, folders)
    expected = {
        (i, adapter): peft_greedy(reference, adapter, ids, TOKENS)
        for i, ids in enumerate(PROMPTS)
        for adapter in CHOICES
    }
    config = with_overrides(
        EngineConfig(),
        model={
            "path": str(root / "base"),
            "dtype": "float32",
            "device": "cpu",
            "adapters": {name: str(path) for name, path in folders.items()},
        },
        kv={"num_pages": 256, "page_size": 4, "prefix_cache": "global"},
    )
    return SimpleNamespace(config=config, peft=reference, expected=expected)


async def open_tiny(tiny: SimpleNamespace, config: EngineConfig | None = None) -> Any:
    driver, tokenizer = await trio.to_thread.run_sync(build_torch_driver, config or tiny.config)
    return open_engine(config or tiny.config, driver=driver, tokenizer=tokenizer)


async def greedy(engine: Engine, ids: list[int], adapter: str | None) -> list[int]:
    async with engine.requester() as requester:
        generation = await generate(
            requester, ids, max_tokens=TOKENS, sampler=Argmax(), adapter=adapter
        )
    return list(generation.tokens)


async def test_greedy_generation_through_an_adapter_equals_peft_alone_and_batched(
    tiny: Any,
) -> None:
    cases = [(i, adapter) for i in range(len(PROMPTS)) for adapter in CHOICES]
    async with await open_tiny(tiny) as engine:
        alone = {case: await greedy(engine, PROMPTS[case[0]], case[1]) for case in cases}
        together: dict[tuple[int, str | None], list[int]] = {}

        async def run(case: tuple[int, str | None]) -> None:
            together[case] = await greedy(engine, PROMPTS[case[0]], case[1])

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for case in cases:
                    nursery.start_soon(run, case)
        stats = engine.statistics()
    assert alone == tiny.expected
    assert together == tiny.expected
    assert stats.scheduler.max_batch_size >= len(CHOICES)
    assert stats.kv.pages_free == stats.kv.pages_total


async def test_the_same_prompt_under_another_adapter_gets_its_own_logits(tiny: Any) -> None:
    prompt = list(range(40, 53))  # three full pages and a token: the cache could offer three
    slot = (SamplingSlot(index=len(prompt) - 1, op=RawLogits()),)
    async with await open_tiny(tiny) as engine, engine.requester() as requester:
        logits = {}
        for adapter in [None, "terse", "verbose", None, "terse"]:
            context = await requester.create_context()
            [out] = await requester.forward(context, prompt, slot, adapter=adapter)
            assert isinstance(out, LogitsOutput)
            logits.setdefault(adapter, []).append(torch.tensor(out.values))
        hit_pages = engine.statistics().kv.prefix_hit_pages
    for adapter, seen in logits.items():
        theirs = peft_logits(tiny.peft, adapter, prompt)[-1]
        assert all((ours - theirs).abs().max().item() <= TINY_TOLERANCE for ours in seen)
    assert hit_pages == 2 * 3  # the second base and terse contexts, three pages each


async def test_an_unknown_adapter_is_refused_and_the_next_request_is_served(tiny: Any) -> None:
    async with await open_tiny(tiny) as engine:
        with pytest.raises(RequestRefused) as refused:
            await greedy(engine, PROMPTS[0], "missing")
        served = await greedy(engine, PROMPTS[0], "sparse")
    assert refused.value.kind == "no_such_adapter"
    assert "no LoRA adapter named 'missing'; loaded: sparse, terse, verbose" in str(refused.value)
    assert served == tiny.expected[(0, "sparse")]


async def test_the_servers_status_lists_the_loaded_adapters(tiny: Any) -> None:
    async with await open_tiny(tiny) as engine:
        status = Server(engine, ServerConfig(auth="off")).engine_status(corr=1)

    assert status.adapters == tuple(ADAPTERS) == engine.info.adapters


async def test_a_malformed_adapter_stops_the_engine_from_starting(
    tiny: Any, tmp_path: Path
) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    config = with_overrides(tiny.config, model={"adapters": {"bad": str(tmp_path)}})

    with pytest.raises(ValueError, match="target_modules must be a list of names"):
        await open_tiny(tiny, config)


# -- through an inferlet ----------------------------------------------------------------------


@pytest.fixture
def guest_config(tiny: Any, pytestconfig: pytest.Config) -> EngineConfig:
    return with_overrides(tiny.config, sandbox={"cache_dir": components_dir(pytestconfig)})


async def test_inferlets_generate_through_adapters_as_peft_does(
    tiny: Any,
    guest_config: EngineConfig,
    built: Callable[[Path], Path],  # noqa: F811
) -> None:
    wasm = built(GUESTS / "lora_probe").read_bytes()
    cases = [(2, adapter, how) for adapter in CHOICES for how in HOWS]
    results: dict[tuple[int, str | None, str], list[int]] = {}
    async with await open_tiny(tiny, guest_config) as engine:
        program = engine.programs.add(wasm).hash
        listed = await run_json(engine, program, {"mode": "adapters"})

        async def run(i: int, adapter: str | None, how: str) -> None:
            request = {"mode": "generate", "prompt": PROMPTS[i], "tokens": TOKENS}
            result = await run_json(engine, program, {**request, "adapter": adapter, "how": how})
            results[(i, adapter, how)] = result["tokens"]

        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for case in cases:
                    nursery.start_soon(run, *case)
        stats = engine.statistics()
    assert listed == {"adapters": list(ADAPTERS)}
    assert results == {case: tiny.expected[case[:2]] for case in cases}
    assert stats.scheduler.max_batch_size > 1
    assert stats.speculation.hits + stats.speculation.direct > 0, "the fast path ran"


HOWS = ("run", "stepped", "forward")


async def test_an_inferlet_told_no_such_adapter_goes_on(
    tiny: Any,
    guest_config: EngineConfig,
    built: Callable[[Path], Path],  # noqa: F811
) -> None:
    wasm = built(GUESTS / "lora_probe").read_bytes()
    request = {"mode": "unknown", "prompt": PROMPTS[1], "tokens": TOKENS, "adapter": "verbose"}
    async with await open_tiny(tiny, guest_config) as engine:
        program = engine.programs.add(wasm).hash
        result = await run_json(engine, program, request)
    assert result["refused"]["kind"] == "no-such-adapter"
    assert "no LoRA adapter named 'missing'" in result["refused"]["message"]
    assert result["tokens"] == tiny.expected[(1, "verbose")]


def reference_logprobs(peft: Any, adapter: str | None, tokens: list[int]) -> torch.Tensor:
    """peft's log-probability of each of `tokens` after PROMPTS[0] and the tokens before it."""
    logits = peft_logits(peft, adapter, [*PROMPTS[0], *tokens])[len(PROMPTS[0]) - 1 : -1]
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


async def test_the_openai_server_serves_each_adapter_as_a_model(
    tiny: Any,
    guest_config: EngineConfig,
    built: Callable[[Path], Path],  # noqa: F811
) -> None:
    wasm = built(OPENAI_SERVER).read_bytes()
    completions = {}
    async with await open_tiny(tiny, guest_config) as engine:
        program = engine.programs.add(wasm, name="openai-server").hash
        mounts = Mounts({OPENAI_PREFIX: program})
        front = HttpFront(engine, HttpConfig(port=0), mounts, host="127.0.0.1")
        base = engine.info.model_name
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run)
            client = client_for(f"{front.url}{OPENAI_PREFIX}")

            def complete(model: str) -> Any:
                return client.completions.create(
                    model=model, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0, logprobs=0
                ).model_dump()

            with trio.fail_after(300):
                listed = await trio.to_thread.run_sync(lambda: client.models.list().model_dump())
                with pytest.raises(openai.NotFoundError, match="does not exist"):
                    await trio.to_thread.run_sync(complete, "no-such-adapter")
                for model in [base, "terse", "verbose"]:
                    completions[model] = await trio.to_thread.run_sync(complete, model)
            front.stop()
            nursery.cancel_scope.cancel()
        stops = engine.tokenizer.stop_token_ids
    assert [card["id"] for card in listed["data"]] == [base, *ADAPTERS]
    assert len({c["choices"][0]["text"] for c in completions.values()}) == 3
    for model, completion in completions.items():
        adapter = None if model == base else model
        expected = tiny.expected[(0, adapter)]
        end = next((i for i, t in enumerate(expected) if t in stops), TOKENS)
        [choice] = completion["choices"]
        assert completion["model"] == model
        assert choice["text"] == engine.tokenizer.decode(expected[:end])
        # Scored on a fork of the prompt, through the same adapter.
        scores = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert (scores - reference_logprobs(tiny.peft, adapter, expected[:end])).abs().max() < 1e-4
