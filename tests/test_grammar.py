"""The grammar engine on its own, over a small trained tokenizer: masks converted between
llguidance's bitmask and run lengths, grammars compiled once per content and refused with the
compiler's message, per-user matcher bounds, matchers stepped and rolled back, and a generation
run that masks every step with its matcher and ends when the grammar is complete."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pie.drivers.tokenizer import Tokenizer
from pie.events.batching import ForwardCompleted
from pie.events.sampling import Argmax, TokenOutput
from pie.grammar import GrammarError, GrammarLimits, Grammars, bitmask_to_rle, intersect
from pie.grammar.masks import runs_to_bools
from pie.sandbox.host.failure import HostFailure
from pie.sandbox.host.matchertable import MatcherTable
from pie.sandbox.host.runs import Run, RunFailed, RunSpec
from tests.tiny_models import VOCAB, write_tiny_tokenizer

pytestmark = pytest.mark.unit
EOS = 0


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder, VOCAB)
    return Tokenizer.from_folder(folder)


def engine(tokenizer: Tokenizer, **limits: Any) -> Grammars:
    return Grammars(tokenizer.backend_json, VOCAB, [EOS], GrammarLimits(**limits))


def allowed(mask: tuple[int, ...]) -> list[int]:
    return [int(t) for t in np.flatnonzero(runs_to_bools(mask, VOCAB))]


@given(st.lists(st.booleans(), min_size=1, max_size=300), st.integers(0, 40))
def test_a_bitmask_becomes_the_run_lengths_of_its_bits(bits: list[bool], extra: int) -> None:
    packed = np.packbits(np.array(bits, dtype=bool), bitorder="little").tobytes()
    runs = bitmask_to_rle(packed, len(bits) + extra)
    expected = bits + [False] * extra
    assert list(runs_to_bools(runs, len(expected))) == expected
    assert runs[0] > 0 or len(runs) == 1 or not expected[0]


@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=200))
def test_intersect_allows_what_both_masks_allow(pairs: list[tuple[bool, bool]]) -> None:
    a = np.array([x for x, _ in pairs])
    b = np.array([y for _, y in pairs])
    ra = bitmask_to_rle(np.packbits(a, bitorder="little").tobytes(), len(pairs))
    rb = bitmask_to_rle(np.packbits(b, bitorder="little").tobytes(), len(pairs))
    both = intersect(ra, rb, len(pairs))
    assert both is not None
    assert list(runs_to_bools(both, len(pairs))) == list(a & b)
    assert intersect(None, rb, len(pairs)) == rb


def test_a_grammar_compiles_once_per_content_and_the_cache_is_bounded(
    tiny_tokenizer: Tokenizer,
) -> None:
    grammars = engine(tiny_tokenizer, cache_entries=2)
    first = grammars.compile("regex", "ab+")
    assert grammars.compile("regex", "ab+") is first
    grammars.compile("lark", 'start: "x"')
    grammars.compile("any-json", "")
    assert grammars.compile("regex", "ab+") is not first  # evicted, compiled again
    stats = grammars.statistics()
    assert (stats.compiled, stats.cache_hits, stats.cached) == (4, 1, 2)


@pytest.mark.parametrize(
    ("kind", "source", "words"),
    [
        ("lark", "start: nowhere", "nowhere"),
        ("regex", "(ab", "does not compile"),
        ("json-schema", "{not json", "not JSON"),
        ("json-schema", "[1]", "object"),
        ("ebnf", "root ::= (", "EBNF"),
        ("yaml", "a: 1", "no grammar kind"),
    ],
)
def test_a_bad_grammar_is_refused_with_what_is_wrong(
    tiny_tokenizer: Tokenizer, kind: str, source: str, words: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(words)) as refused:
        engine(tiny_tokenizer).compile(kind, source)
    assert refused.value.kind == "invalid"


def test_sources_over_the_size_bound_are_refused(tiny_tokenizer: Tokenizer) -> None:
    grammars = engine(tiny_tokenizer, max_source_bytes=64)
    with pytest.raises(GrammarError, match="over 64 bytes"):
        grammars.compile("regex", "a" * 65)
    assert grammars.compile("regex", "a" * 64) is not None


def test_matchers_are_bounded_per_user_and_freed_on_close(tiny_tokenizer: Tokenizer) -> None:
    grammars = engine(tiny_tokenizer, max_matchers_per_user=2)
    compiled = grammars.compile("regex", "[0-9]+")
    held = [grammars.matcher(compiled, "alice") for _ in range(2)]
    with pytest.raises(GrammarError, match="alice") as refused:
        grammars.matcher(compiled, "alice")
    assert refused.value.kind == "quota"
    grammars.matcher(compiled, "bob").close()  # another user is still served
    held[0].close()
    held[0].close()  # closing twice frees once
    grammars.matcher(compiled, "alice")
    assert grammars.statistics().live_matchers == 2


def test_a_matcher_masks_consumes_and_rolls_back(tiny_tokenizer: Tokenizer) -> None:
    grammars = engine(tiny_tokenizer)
    matcher = grammars.matcher(grammars.compile("regex", "ab+"), "alice")
    a, b, x = (tiny_tokenizer.token_to_id(c) for c in "abx")
    first = allowed(matcher.mask())
    assert a in first and b not in first and x not in first
    assert matcher.consume([a, b, x]) == 2  # x is refused, the matcher stays usable
    assert matcher.accepting and not matcher.stopped
    assert EOS in allowed(matcher.mask()) and b in allowed(matcher.mask())
    matcher.rollback(1)
    assert not matcher.accepting
    with pytest.raises(GrammarError):
        matcher.rollback(5)


def test_a_forced_literal_is_known_before_sampling(tiny_tokenizer: Tokenizer) -> None:
    grammars = engine(tiny_tokenizer)
    matcher = grammars.matcher(grammars.compile("lark", 'start: "hello world"'), "alice")
    assert tiny_tokenizer.decode(matcher.forced()) == "hello world"


def grammar_run(
    matcher: Any, choose: Any, max_tokens: int = 20
) -> tuple[Run, list[tuple[int, ...] | None]]:
    """A run whose passes answer at once: `choose(mask)` picks each token."""
    masks: list[tuple[int, ...] | None] = []

    def step(feed: Any, op: Any, shape: Any, deliver: Any) -> None:
        masks.append(shape.mask)
        out = TokenOutput(token=choose(shape.mask))
        deliver(ForwardCompleted(corr=0, context=1, outputs=(out,)))

    spec = RunSpec(
        context=1, feed=(5,), op=Argmax(), max_tokens=max_tokens, stop_tokens=frozenset({EOS})
    )
    return Run(spec, step, lambda ids: "", lambda: None, matcher), masks


def test_a_run_masks_every_step_and_ends_when_the_grammar_is_complete(
    tiny_tokenizer: Tokenizer,
) -> None:
    grammars = engine(tiny_tokenizer)
    matcher = grammars.matcher(grammars.compile("regex", "(ab){2}"), "alice")
    run, masks = grammar_run(matcher, lambda mask: allowed(mask)[-1])
    run.start()
    out = run.take()
    assert out.finished == "grammar"
    assert tiny_tokenizer.decode(list(out.tokens)) == "abab"
    assert len(masks) == len(out.tokens) and all(m is not None for m in masks)
    assert not matcher.claimed and matcher.stopped


def test_a_token_outside_the_mask_fails_the_run_and_frees_the_matcher(
    tiny_tokenizer: Tokenizer,
) -> None:
    grammars = engine(tiny_tokenizer)
    matcher = grammars.matcher(grammars.compile("regex", "a+"), "alice")
    x = tiny_tokenizer.token_to_id("x")
    run, _ = grammar_run(matcher, lambda mask: x)
    run.start()
    with pytest.raises(RunFailed, match="refused"):
        run.take()
    assert run.finished == "error" and not matcher.claimed


def test_a_matcher_drives_one_run_at_a_time(tiny_tokenizer: Tokenizer) -> None:
    grammars = engine(tiny_tokenizer)
    matcher = grammars.matcher(grammars.compile("regex", "a+"), "alice")
    matcher.claim()
    run, _ = grammar_run(matcher, lambda mask: allowed(mask)[0])
    with pytest.raises(GrammarError) as busy:
        run.start()
    assert busy.value.kind == "busy"


def test_the_tokenizer_json_keeps_added_tokens(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    assert '"<|endoftext|>"' in tiny_tokenizer.backend_json()


def test_an_inferlet_holds_a_bounded_number_of_grammars_and_matchers(
    tiny_tokenizer: Tokenizer,
) -> None:
    grammars = engine(tiny_tokenizer)
    handles = iter(range(1, 100))
    table = MatcherTable("alice", 2, lambda: next(handles))
    compiled = grammars.compile("regex", "a+")
    grammar = table.add_grammar(grammars, compiled)
    table.add_grammar(grammars, compiled)
    with pytest.raises(HostFailure) as refused:
        table.add_grammar(grammars, compiled)
    assert refused.value.kind == "quota"
    first, second = table.new_matcher(grammar), table.new_matcher(grammar)
    with pytest.raises(HostFailure) as refused:
        table.new_matcher(grammar)
    assert refused.value.kind == "quota"
    table.free(first)
    table.new_matcher(grammar)  # served again once one is freed
    table.matcher(second).claim()
    with pytest.raises(HostFailure) as busy:
        table.for_program(second)
    assert busy.value.kind == "busy"
    table.close_all()
    assert grammars.statistics().live_matchers == 0
