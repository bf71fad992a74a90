"""Constrained decoding: `Grammar` (compiled in the engine, cached there by content) and
`Matcher` (where one generation stands in it). `ctx.generate(schema=..., regex=...,
grammar=...)` builds both for you; use them directly to step a grammar yourself, for example to
check a draft or to mask a raw forward pass."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from wit_world.imports import grammar as _gr

from inferlet.errors import call

if TYPE_CHECKING:
    from inferlet.model import Model


class Grammar:
    """A grammar compiled for one model. Build one with a class method."""

    def __init__(self, model: Model, source: _gr.Source) -> None:
        self.model = model
        self.handle = call(_gr.compile, model.handle, source)

    @classmethod
    def json_schema(cls, model: Model, schema: Mapping[str, Any] | str | bool) -> Grammar:
        """JSON that validates against `schema` (a dict, JSON text, or True for any JSON)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(model, _gr.Source_JsonSchema(text))

    @classmethod
    def any_json(cls, model: Model) -> Grammar:
        return cls(model, _gr.Source_AnyJson())

    @classmethod
    def regex(cls, model: Model, pattern: str) -> Grammar:
        """Text the whole of which matches `pattern`."""
        return cls(model, _gr.Source_Regex(pattern))

    @classmethod
    def lark(cls, model: Model, text: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (`start: ...`)."""
        return cls(model, _gr.Source_Lark(text))

    @classmethod
    def ebnf(cls, model: Model, text: str) -> Grammar:
        """A grammar in GBNF, llama.cpp's EBNF (`root ::= ...`)."""
        return cls(model, _gr.Source_Ebnf(text))

    def matcher(self) -> Matcher:
        return Matcher(call(_gr.new_matcher, self.handle))

    def free(self) -> None:
        """Forgets the handle (matchers made from it carry on)."""
        call(_gr.free, self.handle)


class Matcher:
    """Where one generation stands in a grammar."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def mask(self) -> list[int]:
        """The tokens allowed next, as run lengths over the vocabulary (a logit mask)."""
        return call(_gr.mask, self.handle)

    def consume(self, tokens: Sequence[int]) -> int:
        """Takes tokens while the grammar allows them; how many it took."""
        return call(_gr.consume, self.handle, list(tokens))

    def rollback(self, count: int) -> None:
        """Forgets the last `count` tokens taken."""
        call(_gr.rollback, self.handle, count)

    def forced(self) -> list[int]:
        """Tokens the grammar leaves no alternative to, from here."""
        return call(_gr.forced, self.handle)

    @property
    def accepting(self) -> bool:
        """What was taken is a complete sentence of the grammar."""
        return call(_gr.status, self.handle).accepting

    @property
    def stopped(self) -> bool:
        """The grammar admits nothing more (but a stop token)."""
        return call(_gr.status, self.handle).stopped

    def free(self) -> None:
        call(_gr.free, self.handle)


def grammar_for(
    model: Model,
    *,
    schema: Mapping[str, Any] | str | bool | None = None,
    regex: str | None = None,
    grammar: str | Grammar | None = None,
) -> Grammar | None:
    """The grammar `ctx.generate` was asked for (at most one of the three), or None."""
    given = [x for x in (schema, regex, grammar) if x is not None]
    if len(given) > 1:
        raise ValueError("give at most one of schema, regex and grammar")
    if schema is not None:
        return Grammar.json_schema(model, schema)
    if regex is not None:
        return Grammar.regex(model, regex)
    if isinstance(grammar, str):
        return Grammar.lark(model, grammar)
    return grammar


def intersect(a: list[int] | None, b: list[int] | None) -> list[int] | None:
    """Run lengths of the tokens both masks allow (None allows every token)."""
    if a is None or b is None:
        return b if a is None else a
    out: list[int] = []
    ia, ib = _runs(a), _runs(b)
    left_a, allowed_a = next(ia)
    left_b, allowed_b = next(ib)
    value, count = True, 0
    while left_a and left_b:
        step = min(left_a, left_b)
        both = allowed_a and allowed_b
        if both != value:
            out.append(count)
            value, count = both, 0
        count += step
        left_a -= step
        left_b -= step
        if not left_a:
            left_a, allowed_a = next(ia, (0, False))
        if not left_b:
            left_b, allowed_b = next(ib, (0, False))
    out.append(count)
    return out


def _runs(mask: list[int]) -> Any:
    """(length, allowed) per non-empty run."""
    for i, length in enumerate(mask):
        if length:
            yield length, i % 2 == 0
