"""What a program may ask of a generation run: a sampler (not a probe), at least one token to
feed and one to make, and stop strings within their bounds; anything else is refused as
`invalid` with the reason."""

from __future__ import annotations

from typing import Any

import pytest
from wasmtime.component import Record, Variant

from pie.events.sampling import Argmax, LogitBias
from pie.sandbox.host.generate import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, run_spec
from pie.sandbox.host.state import HostFailure

pytestmark = pytest.mark.unit


def params(**changes: Any) -> Record:
    fields: dict[str, Any] = {
        "context": 1,
        "tokens": [5, 6],
        "sampler": "argmax",
        "max-tokens": 8,
        "stop-tokens": [2],
        "stop-strings": ["\n\n"],
        "logit-mask": None,
        "logit-bias": [],
        "presence-penalty": 0.0,
        "frequency-penalty": 0.0,
        "matcher": None,
        "deliver-every": 0,
        "text": False,
    }
    fields.update(changes)
    record = Record()
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def refusal(**changes: Any) -> str:
    with pytest.raises(HostFailure) as failure:
        run_spec(params(**changes))
    assert failure.value.kind == "invalid"
    return failure.value.message


def test_a_well_formed_request_becomes_a_run_spec() -> None:
    spec = run_spec(params())
    assert (spec.context, spec.feed, spec.op, spec.max_tokens) == (1, (5, 6), Argmax(), 8)
    assert spec.stop_tokens == frozenset({2}) and spec.stop_strings == ("\n\n",)
    assert spec.logit_bias == ()


def test_a_runs_logit_bias_reaches_its_spec() -> None:
    bias = Record()
    bias.mask, bias.value = [3, 5, 92], -2.0
    spec = run_spec(params(**{"logit-bias": [bias]}))
    assert spec.logit_bias == (LogitBias(mask=(3, 5, 92), value=-2.0),)


def test_a_probe_is_refused_as_the_sampler() -> None:
    assert "probe" in refusal(sampler="entropy")
    distribution = Record()
    distribution.k, distribution.temperature = 5, 1.0
    assert "probe" in refusal(sampler=Variant("distribution", distribution))


def test_too_many_or_too_long_stop_strings_are_refused() -> None:
    assert "stop strings" in refusal(**{"stop-strings": ["x"] * (MAX_STOP_STRINGS + 1)})
    assert "stop strings" in refusal(**{"stop-strings": ["x" * (MAX_STOP_STRING_CHARS + 1)]})
    assert run_spec(params(**{"stop-strings": ["x" * MAX_STOP_STRING_CHARS]}))


def test_nothing_to_feed_or_to_make_is_refused() -> None:
    assert "max_tokens" in refusal(**{"max-tokens": 0})
    assert "feed" in refusal(tokens=[])
