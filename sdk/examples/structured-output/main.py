"""Generates text that a grammar allows: JSON that validates against a schema, text matching a
regex, or a Lark or GBNF grammar. The grammar engine runs in the host and masks every step, so
the engine still carries the whole decode loop; `n` branches fork off one prefilled prompt and
decode together."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import Context, Grammar, Sampler, get_model


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    grammar = choose_grammar(model, input)
    n = int(input.get("n", 1))
    prompt = Context(model)
    if input.get("system"):
        prompt.system(input["system"])
    prompt.user(input["prompt"]).cue()
    await prompt.flush()
    branches = [prompt.fork() for _ in range(n)]
    outputs = await asyncio.gather(
        *(one(branch, grammar, sampler(input, i), input) for i, branch in enumerate(branches))
    )
    if grammar is not None:
        grammar.free()
    return {"outputs": outputs}


async def one(
    ctx: Context, grammar: Grammar | None, sampler: Sampler, input: dict[str, Any]
) -> Any:
    generation = ctx.generate(
        sampler,
        max_tokens=int(input.get("max_tokens", 256)),
        grammar=None if grammar is None else grammar.matcher(),
        presence_penalty=float(input.get("presence_penalty", 0.0)),
        frequency_penalty=float(input.get("frequency_penalty", 0.0)),
    )
    if input.get("stepwise"):
        # The program drives each step itself (masking with the matcher in the guest); the
        # tokens are the same as the engine's own run.
        while not generation.done:
            await generation.step()
    text = await generation.collect_text()
    return {"text": text, "stop_reason": generation.stop_reason, "tokens": len(generation.tokens)}


def choose_grammar(model: Any, input: dict[str, Any]) -> Grammar | None:
    if "schema" in input:
        return Grammar.json_schema(model, input["schema"])
    if "regex" in input:
        return Grammar.regex(model, input["regex"])
    if "lark" in input:
        return Grammar.lark(model, input["lark"])
    if "ebnf" in input:
        return Grammar.ebnf(model, input["ebnf"])
    if input.get("json"):
        return Grammar.any_json(model)
    return None  # unconstrained: the baseline the grammar's cost is measured against


def sampler(input: dict[str, Any], i: int) -> Sampler:
    temperature = float(input.get("temperature", 0.0))
    if temperature == 0:
        return Sampler.argmax()
    seed = input.get("seed")
    return Sampler.multinomial(temperature=temperature, seed=None if seed is None else seed + i)
