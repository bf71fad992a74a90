"""The `grammar` interface: grammars compiled by the model's grammar engine (llguidance) and
matchers a program steps itself or hands to a generation run. Answered on the guest thread."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance, Variant

from pie.grammar import Grammars
from pie.sandbox.host.matchertable import grammar_errors
from pie.sandbox.host.model import model_view
from pie.sandbox.host.state import HostFailure, current, host_call
from pie.sandbox.wasm import add_host_func, record

INTERFACE = "pie:inferlet/grammar@0.1.0"


def compile_(model: int, source: Any) -> int:
    engine = _engine(model)
    kind, text = (source.tag, str(source.payload)) if isinstance(source, Variant) else (source, "")
    with grammar_errors():
        grammar = engine.compile(kind, text)
    return current().grammar.add_grammar(engine, grammar)


def new_matcher(grammar: int) -> int:
    return current().grammar.new_matcher(grammar)


def mask(m: int) -> list[int]:
    with grammar_errors():
        return list(current().grammar.for_program(m).mask())


def consume(m: int, tokens: list[int]) -> int:
    with grammar_errors():
        return current().grammar.for_program(m).consume(tokens)


def rollback(m: int, count: int) -> None:
    with grammar_errors():
        current().grammar.for_program(m).rollback(count)


def forced(m: int) -> list[int]:
    with grammar_errors():
        return current().grammar.for_program(m).forced()


def status(m: int) -> Any:
    matcher = current().grammar.matcher(m)
    return record(accepting=matcher.accepting, stopped=matcher.stopped)


def free(handle: int) -> None:
    current().grammar.free(handle)


def _engine(model: int) -> Grammars:
    engine = model_view(model).grammars
    if engine is None:
        raise HostFailure("invalid", "this model has no grammar engine")
    return engine


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "compile", host_call(compile_))
    add_host_func(instance, "new-matcher", host_call(new_matcher))
    for fn in (mask, consume, rollback, forced, status, free):
        add_host_func(instance, fn.__name__, host_call(fn))
