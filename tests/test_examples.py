"""The example inferlets, built with `pie build` and run by the engine on the real default model
(SmolLM2-135M, float32): greedy text completion equals the engine's own decode, branches run
batched, a saved prefix is reused, every sampler and probe answers, a failing guest frees its
pages, and the two agents (CodeACT, function calling) act inside the inferlet and go on in the same
context, feeding only the new tokens."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.actors.generate import generate, prompt_ids
from pie.config import EngineConfig
from pie.engine import open_engine
from pie.events.inferlet import InferletOutput
from pie.events.sampling import Argmax
from tests.inferlet_fixtures import EXAMPLES, GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.model

Real = tuple[EngineConfig, Any, Any]


@pytest.fixture(scope="module")
def example(built: Callable[[Path], Path]) -> Callable[[str], bytes]:  # noqa: F811
    def wasm(name: str) -> bytes:
        folder = GUESTS / name if name == "misbehave" else EXAMPLES / name
        return built(folder).read_bytes()

    return wasm


async def run(engine: Any, wasm: bytes, request: dict[str, Any], **kwargs: Any) -> Any:
    program = engine.programs.add(wasm)
    with trio.fail_after(300):
        outcome = await engine.run_inferlet(program.hash, json.dumps(request), **kwargs)
    assert outcome.status == "returned", outcome.error
    return outcome.result


async def run_alone(real: Real, wasm: bytes, request: dict[str, Any]) -> Any:
    """The inferlet's JSON result, run on an engine of its own."""
    config, driver, tokenizer = real
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        return json.loads(await run(engine, wasm, request))


async def greedy(engine: Any, ids: list[int], max_tokens: int) -> list[int]:
    stop = engine.tokenizer.stop_token_ids
    async with engine.requester() as req:
        result = await generate(
            req, ids, max_tokens=max_tokens, sampler=Argmax(), stop_tokens=list(stop)
        )
    return [t for t in result.tokens if t not in stop]


async def test_greedy_text_completion_equals_the_engines_own_decode(
    real: Real, example: Callable[[str], bytes]
) -> None:
    config, driver, tokenizer = real
    prompt, system = "Tell me about dragons who bake bread.", "You are a storyteller."
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        wasm = example("text-completion")
        plain = await run(engine, wasm, {"prompt": prompt, "max_tokens": 16, "temperature": 0})
        with_system = await run(engine, wasm, {"prompt": prompt, "system": system, "max_tokens": 8})
        expected = await greedy(engine, prompt_ids(tokenizer, prompt), 16)
        expected_system = await greedy(engine, prompt_ids(tokenizer, prompt, system=system), 8)
    assert len(expected) == 16
    # Re-encoding the text gives back the engine's tokens: the same tokens, not just similar text.
    assert tokenizer.encode(plain) == expected
    assert tokenizer.encode(with_system) == expected_system


async def test_parallel_branches_are_batched_and_a_seed_repeats_them(
    real: Real, example: Callable[[str], bytes]
) -> None:
    config, driver, tokenizer = real
    request = {"prompt": "Name a fruit.", "n": 3, "max_tokens": 8, "temperature": 0.9, "seed": 5}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        first = json.loads(await run(engine, example("parallel-generation"), request))
        again = json.loads(await run(engine, example("parallel-generation"), request))
        stats = engine.statistics()
    assert len(first) == 3 and all(isinstance(t, str) and t for t in first)
    assert first == again
    assert stats.scheduler.max_batch_size >= 3


async def test_a_saved_prefix_is_reused_and_only_the_user_turn_is_prefilled(
    real: Real, example: Callable[[str], bytes]
) -> None:
    config, driver, tokenizer = real
    system = "You are a terse assistant who answers in one short sentence."
    prompts = ["What is 2+2?", "Name a colour."]
    request = {"system": system, "prompts": prompts, "max_tokens": 8}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        built_run = json.loads(await run(engine, example("prefix-caching"), request))
        reused_run = json.loads(await run(engine, example("prefix-caching"), request))
        snapshots = engine.statistics().kv.snapshots
        direct = [await greedy(engine, prompt_ids(tokenizer, p, system=system), 8) for p in prompts]
    messages = [{"role": "system", "content": system}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    snapshot_tokens = len(tokenizer.encode(rendered))
    assert (built_run["reused"], reused_run["reused"]) == (False, True)
    assert built_run["snapshot_tokens"] == reused_run["snapshot_tokens"] == snapshot_tokens
    assert snapshots == 1
    for prompt, answer in zip(prompts, reused_run["requests"], strict=True):
        whole = prompt_ids(tokenizer, prompt, system=system)
        assert answer["prefilled_tokens"] == len(whole) - snapshot_tokens
    # Continuing from the saved pages decodes exactly like prefilling the whole prompt.
    for run_ in (built_run, reused_run):
        assert [tokenizer.encode(r["answer"]) for r in run_["requests"]] == direct


async def test_every_sampler_and_probe_answers_in_one_pass(
    real: Real, example: Callable[[str], bytes]
) -> None:
    config, driver, tokenizer = real
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        summary = json.loads(await run(engine, example("sampler-suite"), {}))
    samplers, dist = summary["samplers"], summary["distribution"]
    assert set(samplers) == {"argmax", "multinomial", "top_k", "top_p", "min_p", "top_k_top_p"}
    assert all(0 <= s["token"] < tokenizer.vocab_size for s in samplers.values())
    assert samplers["argmax"]["token"] == dist["tokens"][0] == summary["raw_logits"]["argmax"]
    assert samplers["top_k"]["token"] in dist["tokens"]
    assert dist["probs"] == sorted(dist["probs"], reverse=True) and sum(dist["probs"]) <= 1.0001
    assert summary["raw_logits"]["length"] == tokenizer.vocab_size
    assert len(summary["logprobs"]["values"]) == 2
    assert all(v <= 0 for v in summary["logprobs"]["values"])
    assert summary["entropy"] > 0


async def test_a_failing_guest_frees_its_pages_and_its_prints_reach_the_launcher(
    real: Real, example: Callable[[str], bytes]
) -> None:
    config, driver, tokenizer = real
    printed: list[tuple[str, str]] = []

    def on_event(event: Any) -> None:
        if isinstance(event, InferletOutput):
            printed.append((event.stream, event.text))

    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        program = engine.programs.add(example("misbehave"))
        failed = await engine.run_inferlet(program.hash, json.dumps({"mode": "contexts"}))
        with trio.fail_after(10):
            while engine.statistics().kv.contexts:
                await trio.sleep(0.01)
        kv = engine.statistics().kv
        output = await run(engine, example("misbehave"), {"mode": "stdout"}, on_event=on_event)
    assert failed.status == "failed"
    assert "RuntimeError: failing with a context" in (failed.error or "")
    assert kv.pages_free == kv.pages_total
    assert output == "printed"
    assert "".join(t for s, t in printed if s == "stdout") == "to stdout\n"
    assert "".join(t for s, t in printed if s == "stderr") == "to stderr\n"


def assert_only_new_tokens_were_fed(tokenizer: Any, result: dict[str, Any]) -> None:
    """Each step after the first fed exactly the turn appended after the previous one (the KV of
    everything before was reused), closed its own turn with the template's end-of-turn tokens,
    and the context holds nothing beyond what the steps fed and generated."""
    steps, closing = result["steps"], len(tokenizer.encode("<|im_end|>\n"))
    for before, after in zip(steps, steps[1:], strict=False):
        assert after["reused"] == before["context"]
        assert after["filled"] == len(tokenizer.encode(before["appended"]))
    assert all(step["closed"] == closing for step in steps)
    fed = sum(step["filled"] + step["generated"] + step["closed"] for step in steps)
    assert result["context_tokens"] == steps[-1]["context"] == fed


async def test_codeact_runs_the_code_and_goes_on_in_the_same_context(
    real: Real, example: Callable[[str], bytes]
) -> None:
    tokenizer = real[2]
    request = {
        "task": "What is the sum of the numbers from 0 to 9?",
        "prefill": "```python\nprint(sum(range(10)))\n```\n",
        "max_steps": 2,
        "max_tokens": 24,
        "check_fresh": True,
    }
    result = await run_alone(real, example("codeact"), request)
    first, second = result["steps"]
    assert (first["stop_reason"], first["generated"]) == ("prefill", 0)
    assert first["code"] == "print(sum(range(10)))\n"
    assert (first["output"], first["failed"]) == ("45\n", False)
    assert first["appended"].startswith("<|im_start|>user\nOutput:\n45<|im_end|>")
    assert second["generated"] > 0
    assert_only_new_tokens_were_fed(tokenizer, result)
    # Greedy decoding on the reused cache gives, token for token, what a fresh prefill gives.
    assert second["fresh_match"] is True


async def test_codeact_feeds_an_exception_back_as_its_traceback(
    real: Real, example: Callable[[str], bytes]
) -> None:
    tokenizer = real[2]
    request = {
        "task": "Divide ten by zero.",
        "prefill": "```python\nten = 10\nprint(ten / 0)\n```\n",
        "max_steps": 2,
        "max_tokens": 8,
    }
    result = await run_alone(real, example("codeact"), request)
    first = result["steps"][0]
    assert first["failed"] is True
    assert first["output"].startswith("Traceback (most recent call last):\n")
    assert 'File "<step 1>", line 2' in first["output"]
    assert first["output"].endswith("ZeroDivisionError: division by zero\n")
    assert "The code failed:\nTraceback" in first["appended"]
    assert "ZeroDivisionError: division by zero<|im_end|>" in first["appended"]
    assert_only_new_tokens_were_fed(tokenizer, result)


ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'


async def test_function_calling_runs_the_tool_and_goes_on_without_prefilling_again(
    real: Real, example: Callable[[str], bytes]
) -> None:
    tokenizer = real[2]
    request = {
        "task": "What is 2 plus 40?",
        "prefill": ADD_CALL,
        "max_steps": 2,
        "max_tokens": 16,
        "check_fresh": True,
    }
    result = await run_alone(real, example("function-calling"), request)
    first, second = result["steps"]
    assert first["call"] == {"name": "add", "arguments": {"a": 2, "b": 40}}
    assert (first["result"], first["error"]) == (42, None)
    response = '<tool_response>\n{"name": "add", "content": 42}\n</tool_response>'
    assert first["appended"] == f"<|im_start|>tool\n{response}<|im_end|>\n<|im_start|>assistant\n"
    assert second["generated"] > 0
    assert_only_new_tokens_were_fed(tokenizer, result)
    assert second["fresh_match"] is True


async def test_a_malformed_or_unknown_tool_call_is_fed_back_as_an_error(
    real: Real, example: Callable[[str], bytes]
) -> None:
    config, driver, tokenizer = real
    calls = {
        "malformed": '<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>',
        "unknown": '<tool_call>{"name": "weather", "arguments": {}}</tool_call>',
    }
    ask = {"task": "What is 2 plus 40?", "max_steps": 2, "max_tokens": 4}
    results = {}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        for kind, call in calls.items():
            request = {**ask, "prefill": call}
            results[kind] = json.loads(await run(engine, example("function-calling"), request))
    expected = {
        "malformed": "the tool call is not valid JSON",
        "unknown": "unknown tool 'weather'; the tools are add, clock, lookup",
    }
    for kind, result in results.items():
        first = result["steps"][0]
        assert (first["call"], first["result"]) == (None, None)
        assert first["error"].startswith(expected[kind])
        assert '<tool_response>\n{"error": "' + expected[kind] in first["appended"]
        assert len(result["steps"]) == 2
        assert_only_new_tokens_were_fed(tokenizer, result)
