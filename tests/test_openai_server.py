"""The OpenAI-compatible endpoint (the `openai-server` example inferlet behind the HTTP front end)
on the real default model, driven by the `openai` Python package: greedy chat completions equal
the engine's own decode token for token, whole or streamed, through Chat Completions and
Responses alike; tool calls hold to their tools' schemas, whole or streamed; streamed logprobs
equal the whole ones; and bad requests get the API's errors."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import jsonschema
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


async def chat(client: openai.OpenAI, **request: Any) -> Any:
    """One Chat Completions call, made from a worker thread (the client blocks)."""
    return await in_thread(lambda: client.chat.completions.create(**request))


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
            "store": {"store": True},
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
        base = dict(model=engine.info.model_name, messages=MESSAGES, max_tokens=4, temperature=0)
        with trio.fail_after(600):
            plain = await chat(client, **base)
            first = tokenizer.encode(plain.choices[0].message.content)[0]
            zebra = tokenizer.encode("Zebra")[0]
            banned = await chat(client, **base, logit_bias={str(first): -100})
            forced = await chat(client, **base, logit_bias={str(zebra): 100})
            with pytest.raises(openai.BadRequestError, match="logit_bias") as error:
                await chat(client, **base, logit_bias={"-3": 5})
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
        base = dict(model=engine.info.model_name, messages=prompt, max_tokens=40, temperature=0)
        with trio.fail_after(600):
            plain = await chat(client, **base)
            penalised = await chat(client, **base, frequency_penalty=1.5, presence_penalty=0.5)

    def repeats(text: str) -> int:
        tokens = tokenizer.encode(text)
        return len(tokens) - len(set(tokens))

    assert repeats(plain.choices[0].message.content) > 10
    assert (
        repeats(penalised.choices[0].message.content)
        < repeats(plain.choices[0].message.content) / 2
    )


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SUM = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
    },
    "required": ["query"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": SUM, "search": SEARCH}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": p}}
    for name, p in SCHEMAS.items()
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TOKENS = 100
"""Enough for any call to the tools above; their fields are bounded."""


def assert_valid_call(call: Any) -> None:
    """A call names one of TOOLS, and its arguments are JSON that fits that tool's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_required_tool_choice_calls_a_tool_with_arguments_that_fit_its_schema(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        with trio.fail_after(600):
            reply = await chat(
                client,
                model=engine.info.model_name,
                messages=WEATHER_QUESTION,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=CALL_TOKENS,
                temperature=1.0,
                seed=3,
                n=3,
            )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert_valid_call(call)
    ids = [c.message.tool_calls[0].id for c in reply.choices]
    assert len(set(ids)) == 3


async def test_a_named_tool_is_called_and_streams_as_the_same_call(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)

        def call_add(**extra: Any) -> Any:
            return client.chat.completions.create(
                model=engine.info.model_name,
                messages=[{"role": "user", "content": "What is 12 plus 30?"}],
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "add"}},
                max_tokens=CALL_TOKENS,
                temperature=0,
                **extra,
            )

        with trio.fail_after(600):
            whole = await in_thread(call_add)
            chunks = await in_thread(lambda: list(call_add(stream=True)))
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "add"
    assert_valid_call(call)
    assert whole.choices[0].finish_reason == "tool_calls"
    # The stream's deltas assemble into the same call.
    streamed: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            part = streamed.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            part["id"] += delta.id or ""
            part["name"] += delta.function.name or ""
            part["arguments"] += delta.function.arguments or ""
    assert list(streamed) == [0]
    assert streamed[0]["name"] == "add" and streamed[0]["id"].startswith("call_")
    assert streamed[0]["arguments"] == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_auto_answers_in_text_or_a_valid_call_and_none_never_calls(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)

        def ask(**extra: Any) -> Any:
            return client.chat.completions.create(
                model=engine.info.model_name, messages=WEATHER_QUESTION, temperature=0, **extra
            )

        with trio.fail_after(600):
            # One short call at most, so that it fits in the tokens a text answer may run to.
            auto = await in_thread(
                lambda: ask(
                    tools=TOOLS[:1], tool_choice="auto", parallel_tool_calls=False, max_tokens=40
                )
            )
            declined = await in_thread(lambda: ask(tools=TOOLS, tool_choice="none", max_tokens=8))
            plain = await in_thread(lambda: ask(max_tokens=8))
    choice = auto.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert_valid_call(call)
    else:
        assert choice.message.content
        assert not choice.message.content.lstrip().startswith("<tool_call>")
        assert choice.finish_reason in ("stop", "length")
    # With `none` the tools are not offered at all: the prompt and reply are those without tools.
    assert declined.choices[0].message.tool_calls is None
    assert declined.choices[0].message.content == plain.choices[0].message.content
    assert declined.usage.prompt_tokens == plain.usage.prompt_tokens


async def test_a_tool_result_is_rendered_as_a_turn_and_answered(
    real: Any, server_wasm: bytes
) -> None:
    _, _, tokenizer = real
    arguments = '{"city": "Paris", "unit": "celsius"}'
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    turns = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        with trio.fail_after(600):
            reply = await chat(
                client,
                model=engine.info.model_name,
                messages=turns,
                tools=TOOLS,
                tool_choice="none",
                max_tokens=8,
                temperature=0,
            )
    assert reply.choices[0].message.content
    # The call is written as the model writes one, and the result as a user turn.
    rendered = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": f'<tool_call>{{"name": "get_weather", "arguments": '
            f"{arguments}}}</tool_call>",
        },
        {"role": "user", "content": "<tool_response>\n18 degrees and sunny\n</tool_response>"},
    ]
    expected = tokenizer.encode(tokenizer.apply_chat_template(rendered))
    assert reply.usage.prompt_tokens == len(expected)


async def test_bad_tool_requests_are_refused_by_field_and_the_endpoint_serves_on(
    real: Any, server_wasm: bytes
) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)

        def complete(**overrides: Any) -> Any:
            request: dict[str, Any] = {
                "model": engine.info.model_name,
                "messages": WEATHER_QUESTION,
                "tools": TOOLS,
                "max_tokens": 2,
            }
            return client.chat.completions.create(**{**request, **overrides})

        def tool(**function: Any) -> list[dict[str, Any]]:
            return [{"type": "function", "function": function}]

        orphan = [*WEATHER_QUESTION, {"role": "tool", "content": "18 degrees"}]
        refused = {
            "tool_choice.function.name": {
                "tool_choice": {"type": "function", "function": {"name": "multiply"}}
            },
            "tools[0].function.parameters": {
                "tools": tool(name="f", parameters={"type": "nonsense"})
            },
            "tools[0].function.name": {"tools": tool(description="no name", parameters=SUM)},
            "tools[0].function.frobnicate": {"tools": tool(name="f", frobnicate=1)},
            "messages[1].tool_call_id": {"messages": orphan},
        }
        with trio.fail_after(600):
            for field, overrides in refused.items():
                with pytest.raises(openai.BadRequestError) as error:
                    await in_thread(lambda: complete(**overrides))  # noqa: B023
                assert error.value.body["param"] == field
            served = await in_thread(
                lambda: complete(tool_choice="required", max_tokens=CALL_TOKENS)
            )
    assert_valid_call(served.choices[0].message.tool_calls[0])


async def test_streamed_logprobs_equal_the_whole_ones(real: Any, server_wasm: bytes) -> None:
    async with openai_endpoint(real, server_wasm) as (engine, url):
        client = client_for(url)
        model = engine.info.model_name

        def chat(**extra: Any) -> Any:
            return client.chat.completions.create(
                model=model,
                messages=MESSAGES,
                max_tokens=8,
                temperature=0,
                logprobs=True,
                top_logprobs=3,
                **extra,
            )

        def complete(**extra: Any) -> Any:
            return client.completions.create(
                model=model,
                prompt="The capital of France is",
                max_tokens=6,
                temperature=0,
                logprobs=2,
                **extra,
            )

        with trio.fail_after(600):
            whole = await in_thread(chat)
            chunks = await in_thread(lambda: list(chat(stream=True)))
            legacy = await in_thread(complete)
            pieces = await in_thread(lambda: list(complete(stream=True)))
    expected = whole.choices[0].logprobs.content
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    for got, want in zip(streamed, expected, strict=True):
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [t.logprob for t in want.top_logprobs], abs=1e-4
        )
    # Each chunk carries the log-probabilities of its own tokens.
    for chunk in chunks:
        choice = chunk.choices[0]
        if choice.delta.content:
            assert "".join(e.token for e in choice.logprobs.content) == choice.delta.content
    scored = legacy.choices[0].logprobs
    parts = [c.choices[0].logprobs for c in pieces if c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == scored.tokens
    assert sum((p.text_offset for p in parts), []) == scored.text_offset
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(
        scored.token_logprobs, abs=1e-4
    )
    tops = [t for p in parts for t in p.top_logprobs]
    assert [sorted(t) for t in tops] == [sorted(t) for t in scored.top_logprobs]
