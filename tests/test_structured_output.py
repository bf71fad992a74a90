"""Constrained decoding on the real default model through the structured-output example: JSON
that validates against several schemas, regex output that full-matches, a grammar that changes
what the unconstrained model would say, the engine's run equal to the program's own steps, and
bad grammars refused with the compiler's message while the engine goes on serving."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio

from pie.engine import open_engine
from tests.inferlet_fixtures import EXAMPLES
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir, real  # noqa: F401  (fixtures)

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = {
    "nested objects": (
        "Describe a person who lives in a city, as JSON.",
        {
            "type": "object",
            "properties": {
                "person": PERSON,
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
            "required": ["person", "address"],
            "additionalProperties": False,
        },
    ),
    "enums": (
        "What colour is the sky, and how sure are you? Answer in JSON.",
        {
            "type": "object",
            "properties": {
                "colour": {"enum": ["red", "green", "blue", "grey"]},
                "confidence": {"enum": ["low", "medium", "high"]},
            },
            "required": ["colour", "confidence"],
            "additionalProperties": False,
        },
    ),
    "arrays": (
        "List three fruits as JSON.",
        {
            "type": "object",
            "properties": {
                "fruits": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 16},
                    "minItems": 1,
                    "maxItems": 4,
                }
            },
            "required": ["fruits"],
            "additionalProperties": False,
        },
    ),
    "bounded numbers": (
        "Give the temperature in Paris today and a rating from 1 to 5, as JSON.",
        {
            "type": "object",
            "properties": {
                "celsius": {"type": "number", "minimum": -30, "maximum": 45},
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["celsius", "rating"],
            "additionalProperties": False,
        },
    ),
    "array of objects": (
        "Name two people and their ages as JSON.",
        {"type": "array", "items": PERSON, "minItems": 2, "maxItems": 2},
    ),
}


@pytest.fixture(scope="module")
def wasm(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(EXAMPLES / "structured-output").read_bytes()


async def run(engine: Any, wasm: bytes, request: dict[str, Any]) -> Any:
    program = engine.programs.add(wasm)
    with trio.fail_after(600):
        outcome = await engine.run_inferlet(program.hash, json.dumps(request))
    return outcome


async def outputs(engine: Any, wasm: bytes, request: dict[str, Any]) -> list[dict[str, Any]]:
    outcome = await run(engine, wasm, request)
    assert outcome.status == "returned", outcome.error
    result: list[dict[str, Any]] = json.loads(outcome.result)["outputs"]
    return result


async def test_thirty_sampled_generations_validate_against_their_schemas(
    real: Any,  # noqa: F811
    wasm: bytes,
) -> None:
    config, driver, tokenizer = real
    generated: list[tuple[str, dict[str, Any]]] = []
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        for i, (name, (prompt, schema)) in enumerate(SCHEMAS.items()):
            request = {
                "prompt": prompt,
                "schema": schema,
                "n": 6,
                "temperature": 0.8,
                "seed": 100 * i,
                "max_tokens": 160,
            }
            generated += [(name, out) for out in await outputs(engine, wasm, request)]
        stats = engine.inferlets.models[0].grammars.statistics()
    assert len(generated) == 30
    for name, out in generated:
        assert out["stop_reason"] in ("grammar", "stop_token"), (name, out)
        jsonschema.validate(json.loads(out["text"]), SCHEMAS[name][1])
    # Five schemas, compiled once each: the branches' matchers are copies.
    assert stats.compiled == 5
    assert stats.masks >= sum(out["tokens"] for _, out in generated)
    print(f"mask per token: {1e6 * stats.mask_seconds / stats.masks:.0f} us over {stats.masks}")


async def test_regex_output_full_matches_and_a_grammar_changes_what_the_model_says(
    real: Any,  # noqa: F811
    wasm: bytes,
) -> None:
    config, driver, tokenizer = real
    prompt = "Is the sea wet? Reply with one word."
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        dates = await outputs(
            engine,
            wasm,
            {
                "prompt": "When did it happen?",
                "regex": pattern,
                "n": 3,
                "temperature": 0.9,
                "seed": 7,
            },
        )
        free = await outputs(
            engine, wasm, {"prompt": prompt, "lark": "start: /(.|\\n)*/", "max_tokens": 6}
        )
        forced = await outputs(
            engine, wasm, {"prompt": prompt, "lark": 'start: "No" | "Maybe"', "max_tokens": 6}
        )
        ebnf = await outputs(engine, wasm, {"prompt": prompt, "ebnf": 'root ::= "Maybe" "!"'})
    for out in dates:
        assert re.fullmatch(pattern, out["text"]), out
        assert out["stop_reason"] == "grammar"
    # The unconstrained answer starts with neither word the grammar allows...
    assert not free[0]["text"].startswith(("No", "Maybe")), free
    # ...so the grammar changed the output.
    assert forced[0]["text"] in ("No", "Maybe") and forced[0]["stop_reason"] == "grammar"
    assert ebnf[0]["text"] == "Maybe!"


async def test_the_engines_run_equals_the_programs_own_steps(
    real: Any,  # noqa: F811
    wasm: bytes,
) -> None:
    config, driver, tokenizer = real
    prompt, schema = SCHEMAS["nested objects"]
    request = {"prompt": prompt, "schema": schema, "n": 2, "temperature": 0.7, "seed": 3}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        by_run = await outputs(engine, wasm, request)
        by_steps = await outputs(engine, wasm, {**request, "stepwise": True})
    assert by_run == by_steps


async def test_penalties_are_the_same_in_the_engines_run_and_the_programs_steps(
    real: Any,  # noqa: F811
    wasm: bytes,
) -> None:
    config, driver, tokenizer = real
    request = {
        "prompt": "Write the word apple ten times.",
        "n": 2,
        "temperature": 0.7,
        "seed": 3,
        "max_tokens": 24,
        "presence_penalty": 0.4,
        "frequency_penalty": 1.2,
    }
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        by_run = await outputs(engine, wasm, request)
        by_steps = await outputs(engine, wasm, {**request, "stepwise": True})
        plain = await outputs(engine, wasm, {**request, "frequency_penalty": 0.0})
    assert by_run == by_steps
    assert by_run != plain


async def test_a_bad_grammar_is_refused_with_the_compilers_message(
    real: Any,  # noqa: F811
    wasm: bytes,
) -> None:
    config, driver, tokenizer = real
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        bad_lark = await run(engine, wasm, {"prompt": "hi", "lark": "start: nowhere"})
        bad_schema = await run(engine, wasm, {"prompt": "hi", "schema": "{not json"})
        good = await outputs(engine, wasm, {"prompt": "Say yes.", "regex": "yes|no"})
        stats = engine.inferlets.models[0].grammars.statistics()
    assert bad_lark.status == "failed" and "nowhere" in bad_lark.error
    assert bad_schema.status == "failed" and "not JSON" in bad_schema.error
    assert good[0]["text"] in ("yes", "no")
    # Every matcher was freed with its inferlet.
    assert stats.live_matchers == 0
