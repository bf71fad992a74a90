"""What one pass may ask the driver to read out: the kv core refuses, as invalid and before
placing anything, a pass with too many slots or whose probes would return too many values."""

from __future__ import annotations

import pytest

from pie.actors.kv import KvCore, OutputLimits
from pie.events import kv as ev
from pie.events.batching import ScheduleForward
from pie.events.sampling import (
    Argmax,
    Distribution,
    Entropy,
    LogProbs,
    RawLogits,
    SamplingSlot,
    SlotOp,
)

pytestmark = pytest.mark.unit

VOCAB = 100


def core(max_slots: int = 8, max_values: int = 250) -> KvCore:
    limits = OutputLimits(max_slots=max_slots, max_values=max_values)
    kv = KvCore(num_pages=16, page_size=4, vocab_size=VOCAB, outputs=limits)
    kv.handle(ev.CreateContext(corr=1, requester="a"))
    return kv


def submit(kv: KvCore, ops: list[SlotOp]) -> object:
    slots = tuple(SamplingSlot(index=i, op=op) for i, op in enumerate(ops))
    event = ev.SubmitForward(
        corr=2, requester="a", context=1, tokens=tuple(range(1, len(ops) + 1)), slots=slots
    )
    [(_, reply)] = kv.handle(event)
    return reply


def refusal(kv: KvCore, ops: list[SlotOp]) -> str:
    reply = submit(kv, ops)
    assert isinstance(reply, ev.RequestFailed) and reply.kind == "invalid", reply
    assert kv.pool.free == 16 and kv.contexts[1].tokens == []
    return reply.message


def test_a_pass_with_more_slots_than_allowed_is_invalid_and_one_at_the_limit_runs() -> None:
    kv = core(max_slots=8)
    assert "9 sampling and probe slots" in refusal(kv, [Entropy()] * 9)
    assert "max_slots_per_pass" in refusal(kv, [Argmax()] * 9)
    assert isinstance(submit(kv, [Entropy()] * 8), ScheduleForward)


def test_raw_logits_count_the_vocabulary_per_row() -> None:
    kv = core(max_values=250)
    message = refusal(kv, [RawLogits()] * 3)
    assert "300 values" in message and "max_probe_values" in message
    assert isinstance(submit(kv, [RawLogits(), RawLogits(), Entropy()]), ScheduleForward)


def test_distributions_count_two_values_per_token_up_to_the_vocabulary() -> None:
    kv = core(max_values=250)
    assert "400 values" in refusal(kv, [Distribution(k=1000), Distribution(k=1000)])
    assert "252 values" in refusal(kv, [Distribution(k=63), Distribution(k=63)])
    assert isinstance(submit(kv, [Distribution(k=125)]), ScheduleForward)


def test_logprobs_count_their_tokens() -> None:
    kv = core(max_values=250)
    assert "251 values" in refusal(kv, [LogProbs(tokens=(1,) * 250), Argmax()])
    assert isinstance(submit(kv, [LogProbs(tokens=(1,) * 249), Argmax()]), ScheduleForward)
