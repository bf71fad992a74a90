"""The OpenAI-compatible endpoint (the `openai-server` example inferlet behind the HTTP front end)
on the real default model, driven by the `openai` Python package: greedy chat completions equal
the engine's own decode token for token, whole or streamed, through Chat Completions and
Responses alike, and bad requests get the API's errors."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from pie.actors.generate import generate, prompt_ids
from pie.config import HttpConfig
from pie.engine import open_engine
from pie.events.sampling import Argmax
from pie.server.http import HttpFront
from pie.server.mounts import OPENAI_PREFIX, OPENAI_SERVER, Mounts
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.model

PROMPT = "Name three colours of the rainbow."
SYSTEM = "You answer briefly."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
TOKENS = 12


@pytest.fixture(scope="module")
def server_wasm(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(OPENAI_SERVER).read_bytes()


@contextlib.asynccontextmanager
async def openai_endpoint(real: Any, wasm: bytes) -> AsyncIterator[tuple[Any, str]]:
    """An engine with the OpenAI API at <url>/v1, and the engine."""
    config, driver, tokenizer = real
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        program = engine.programs.add(wasm, name="openai-server").hash
        mounts = Mounts({OPENAI_PREFIX: program})
        front = HttpFront(engine, HttpConfig(port=0), mounts, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run)
            yield engine, f"{front.url}{OPENAI_PREFIX}"
            front.stop()
            nursery.cancel_scope.cancel()


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def test_completions_equal_the_engines_decode_whole_and_streamed(
    real: Any, server_wasm: bytes
) -> None:
    _, _, tokenizer = real
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        with trio.fail_after(600):
            model = (await in_thread(lambda: client.models.list())).data[0].id
            whole = await in_thread(
                lambda: client.chat.completions.create(
                    model=model, messages=MESSAGES, max_tokens=TOKENS, temperature=0
                )
            )
            chunks = await in_thread(
                lambda: list(
                    client.chat.completions.create(
                        model=model,
                        messages=MESSAGES,
                        max_tokens=TOKENS,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
            )
            async with engine.requester() as requester:
                ids = prompt_ids(tokenizer, PROMPT, system=SYSTEM)
                stop = list(tokenizer.stop_token_ids)
                reference = await generate(
                    requester, ids, max_tokens=TOKENS, sampler=Argmax(), stop_tokens=stop
                )
    assert model == engine.info.model_name
    expected = [t for t in reference.tokens if t not in stop]
    finish = "length" if len(expected) == TOKENS else "stop"
    text = whole.choices[0].message.content
    # Re-encoding the text gives back the engine's tokens: the same tokens, not just similar text.
    assert tokenizer.encode(text) == expected
    assert whole.choices[0].finish_reason == finish
    assert whole.usage.completion_tokens == len(expected)
    assert whole.usage.prompt_tokens == len(ids)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == text and len([d for d in deltas if d]) > 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == len(expected)


async def test_the_responses_api_gives_the_same_text_whole_and_as_events(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name
        with trio.fail_after(600):
            chat = await in_thread(
                lambda: client.chat.completions.create(
                    model=model, messages=MESSAGES, max_tokens=TOKENS, temperature=0
                )
            )
            whole = await in_thread(
                lambda: client.responses.create(
                    model=model,
                    instructions=SYSTEM,
                    input=PROMPT,
                    max_output_tokens=TOKENS,
                    temperature=0,
                )
            )
            events = await in_thread(
                lambda: list(
                    client.responses.create(
                        model=model,
                        instructions=SYSTEM,
                        input=[{"role": "user", "content": PROMPT}],
                        max_output_tokens=TOKENS,
                        temperature=0,
                        stream=True,
                    )
                )
            )
    expected = chat.choices[0].message.content
    assert whole.output_text == expected
    complete = chat.choices[0].finish_reason == "stop"
    assert whole.status == ("completed" if complete else "incomplete")
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == ("response.completed" if complete else "response.incomplete")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected and len(deltas) > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == expected


async def test_bad_requests_get_the_apis_errors_and_the_endpoint_serves_on(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name

        def complete(**overrides: Any) -> Any:
            request: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 2}
            return client.chat.completions.create(**{**request, **overrides})

        with trio.fail_after(600):
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                await in_thread(lambda: complete(model="gpt-nothing"))
            with pytest.raises(openai.BadRequestError, match="temperature"):
                await in_thread(lambda: complete(temperature=7))
            with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
                await in_thread(lambda: complete(messages=[{"role": "robot", "content": "x"}]))
            with pytest.raises(openai.NotFoundError, match="no route"):
                await in_thread(lambda: client.embeddings.create(model=model, input="x"))
            after = await in_thread(lambda: complete(temperature=0))
    assert after.choices[0].message.content


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=100)


CITY_PROMPT = [{"role": "user", "content": "Describe a large city as JSON."}]


async def test_response_format_holds_the_output_to_the_schema(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name
        with trio.fail_after(600):
            parsed = await in_thread(
                lambda: client.chat.completions.parse(
                    model=model, messages=CITY_PROMPT, response_format=City, temperature=0
                )
            )
            anything = await in_thread(
                lambda: client.chat.completions.create(
                    model=model,
                    messages=CITY_PROMPT,
                    response_format={"type": "json_object"},
                    temperature=0.8,
                    seed=5,
                )
            )
            answer = await in_thread(
                lambda: client.responses.parse(
                    model=model, input="Describe a small city as JSON.", text_format=City
                )
            )
            with pytest.raises(openai.BadRequestError, match="response_format"):
                await in_thread(
                    lambda: client.chat.completions.create(
                        model=model,
                        messages=CITY_PROMPT,
                        response_format={
                            "type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                        },
                    )
                )
    # The client's own parser (pydantic) accepts what came back.
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    assert isinstance(answer.output_parsed, City)


async def test_n_choices_fork_one_prefill_and_repeat_with_a_seed(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name

        def complete(**extra: Any) -> Any:
            return client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11, n=3, **extra
            )

        with trio.fail_after(600):
            first = await in_thread(complete)
            again = await in_thread(complete)
            chunks = await in_thread(lambda: list(complete(stream=True)))
            single = await in_thread(
                lambda: client.chat.completions.create(
                    model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11
                )
            )
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # each choice draws with its own seed
    assert texts[0] == single.choices[0].message.content  # choice 0 draws with `seed`
    # The prompt is prefilled (and counted) once for all three choices.
    assert first.usage.prompt_tokens == single.usage.prompt_tokens
    cut = [c.finish_reason == "length" for c in first.choices]
    assert (first.usage.completion_tokens == 24) == all(cut)
    streamed = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts


async def test_unsupported_fields_are_refused_by_name_and_defaults_pass(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name

        def complete(**overrides: Any) -> Any:
            request: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 2}
            return client.chat.completions.create(**{**request, **overrides})

        refused = {
            "prediction": {"prediction": {"type": "content", "content": "Red"}},
            "audio": {"audio": {"voice": "alloy", "format": "wav"}},
            "frequency_penalty": {"frequency_penalty": 3.0},
            "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "frobnicate": {"extra_body": {"frobnicate": 1}},
            "n": {"n": 17},
            "top_logprobs": {"logprobs": True, "top_logprobs": 21},
        }
        with trio.fail_after(600):
            for field, overrides in refused.items():
                with pytest.raises(openai.BadRequestError, match=field) as error:
                    await in_thread(lambda: complete(**overrides))  # noqa: B023
                assert error.value.body["param"] == field
            with pytest.raises(openai.BadRequestError, match="top_k"):
                await in_thread(
                    lambda: client.responses.create(
                        model=model, input="hi", extra_body={"top_k": 3}
                    )
                )
            served = await in_thread(
                lambda: complete(presence_penalty=0, frequency_penalty=0, logprobs=False, n=1)
            )
    assert served.choices[0].message.content


async def test_logit_bias_is_honoured_and_a_bad_one_refused(real: Any, server_wasm: bytes) -> None:
    _, _, tokenizer = real
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name

        def complete(**extra: Any) -> Any:
            return client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=4, temperature=0, **extra
            )

        with trio.fail_after(600):
            plain = await in_thread(complete)
            first = tokenizer.encode(plain.choices[0].message.content)[0]
            zebra = tokenizer.encode("Zebra")[0]
            banned = await in_thread(lambda: complete(logit_bias={str(first): -100}))
            forced = await in_thread(lambda: complete(logit_bias={str(zebra): 100}))
            with pytest.raises(openai.BadRequestError, match="logit_bias") as error:
                await in_thread(lambda: complete(logit_bias={"-3": 5}))
            assert error.value.body["param"] == "logit_bias"
    assert tokenizer.encode(banned.choices[0].message.content)[0] != first
    assert forced.choices[0].message.content.startswith(tokenizer.decode([zebra]))


async def test_chat_logprobs_list_each_token_with_its_likeliest_alternatives(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name
        with trio.fail_after(600):
            reply = await in_thread(
                lambda: client.chat.completions.create(
                    model=model,
                    messages=MESSAGES,
                    max_tokens=6,
                    temperature=0,
                    logprobs=True,
                    top_logprobs=3,
                )
            )
            with pytest.raises(openai.BadRequestError, match="logprobs"):
                await in_thread(
                    lambda: client.chat.completions.create(
                        model=model, messages=MESSAGES, logprobs=True, stream=True
                    )
                )
    content = reply.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        alternatives = entry.top_logprobs
        assert len(alternatives) == 3 and entry.logprob <= 0
        # Greedy: the chosen token is the likeliest, with the same log-probability.
        assert alternatives[0].token == entry.token
        assert alternatives[0].logprob == pytest.approx(entry.logprob, abs=1e-3)
        assert [a.logprob for a in alternatives] == sorted(
            (a.logprob for a in alternatives), reverse=True
        )


async def test_legacy_completions_equal_the_engines_decode_and_score_the_prompt(
    real: Any,
    server_wasm: bytes,
    default_model_dir: Path,  # noqa: F811
) -> None:
    _, _, tokenizer = real
    prompt = "The capital of France is"
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name
        with trio.fail_after(600):
            whole = await in_thread(
                lambda: client.completions.create(
                    model=model, prompt=prompt, max_tokens=8, temperature=0
                )
            )
            pieces = await in_thread(
                lambda: list(
                    client.completions.create(
                        model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True
                    )
                )
            )
            echoed = await in_thread(
                lambda: client.completions.create(
                    model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2
                )
            )
            async with engine.requester() as requester:
                ids = tokenizer.encode(prompt)
                reference = await generate(requester, ids, max_tokens=8, sampler=Argmax())
    assert tokenizer.encode(whole.choices[0].text) == list(reference.tokens)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == whole.choices[0].text
    scored = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(prompt)
    assert scored.token_logprobs[0] is None and len(scored.tokens) == len(ids) + 1
    # The prompt's log-probabilities match transformers' own, float32.
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [logits[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert scored.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=2e-3)
    assert all(len(top) == 2 for top in scored.top_logprobs[1:])


async def test_frequency_and_presence_penalties_cut_repetition(
    real: Any, server_wasm: bytes
) -> None:
    _, _, tokenizer = real
    prompt = [
        {"role": "user", "content": "Write the word apple twenty times, separated by commas."}
    ]
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name

        def complete(**extra: Any) -> Any:
            return client.chat.completions.create(
                model=model, messages=prompt, max_tokens=40, temperature=0, **extra
            )

        with trio.fail_after(600):
            plain = await in_thread(complete)
            penalised = await in_thread(
                lambda: complete(frequency_penalty=1.5, presence_penalty=0.5)
            )

    def repeats(text: str) -> int:
        tokens = tokenizer.encode(text)
        return len(tokens) - len(set(tokens))

    assert repeats(plain.choices[0].message.content) > 10
    assert (
        repeats(penalised.choices[0].message.content)
        < repeats(plain.choices[0].message.content) / 2
    )
