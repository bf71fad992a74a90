"""A subscription's buffer as the host keeps it: bounded in messages and in bytes, per
subscription and across an instance's subscriptions; past a bound the oldest messages go and the
subscriber's next read is an overrun, then the messages kept."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from pie.events import bus as bus_ev
from pie.events.kv import Done
from pie.sandbox.host import HostFailure, InstanceState
from pie.sandbox.runtime import KillSwitch

pytestmark = pytest.mark.unit


class AnsweringBridge:
    """Answers every command to the bus at once, as the bus would."""

    def __init__(self) -> None:
        self.state: InstanceState | None = None

    def post(self, dst: str, event: Any) -> None:
        assert self.state is not None and dst == "bus"
        self.state.deliver(Done(corr=event.corr))


def instance(**bounds: int) -> InstanceState:
    bridge = AnsweringBridge()
    state = InstanceState(
        instance="i1",
        address="inferlet:i1",
        user="ann",
        bridge=bridge,
        models=[],
        kill=KillSwitch(),
        corr=itertools.count(1),
        budget_seconds=60.0,
        version="test",
        **bounds,
    )
    bridge.state = state
    return state


def publish(state: InstanceState, sub: int, *messages: str) -> None:
    corr = state.topics.subscriptions[sub].corr
    for message in messages:
        state.deliver(bus_ev.TopicMessage(corr=corr, topic="t", sender="p", message=message))


def read(state: InstanceState, sub: int, count: int) -> list[str]:
    """The next `count` reads of the subscription, an overrun read as "overrun"."""
    out = []
    for _ in range(count):
        handle = state.next_message(sub)
        try:
            out.append(state.take(handle, "message"))
        except HostFailure as failure:
            assert failure.kind == "overrun"
            out.append("overrun")
    return out


def test_messages_wait_in_order_within_the_bounds() -> None:
    state = instance(subscription_buffer=3, subscription_bytes=3)
    sub = state.subscribe("t")
    publish(state, sub, "a", "b", "c")
    assert read(state, sub, 3) == ["a", "b", "c"]
    assert state.topics.buffered == 0


def test_past_the_message_bound_the_oldest_are_dropped_and_reported_first() -> None:
    state = instance(subscription_buffer=2)
    sub = state.subscribe("t")
    publish(state, sub, "a", "b", "c", "d")
    assert read(state, sub, 3) == ["overrun", "c", "d"]


def test_past_the_byte_bound_the_oldest_are_dropped() -> None:
    state = instance(subscription_bytes=10)
    sub = state.subscribe("t")
    publish(state, sub, "1234", "5678", "abcd")
    assert state.topics.subscriptions[sub].bytes == 8
    assert read(state, sub, 3) == ["overrun", "5678", "abcd"]


def test_the_overrun_says_how_many_were_dropped_on_which_topic() -> None:
    state = instance(subscription_bytes=4)
    sub = state.subscribe("t")
    publish(state, sub, "1234", "5678", "abcd")
    with pytest.raises(HostFailure, match="2 messages on 't' were dropped"):
        state.take(state.next_message(sub), "message")
    assert read(state, sub, 1) == ["abcd"]


def test_bytes_are_counted_in_utf8() -> None:
    state = instance(subscription_bytes=4)
    sub = state.subscribe("t")
    publish(state, sub, "éé", "é")
    assert read(state, sub, 2) == ["overrun", "é"]


def test_a_message_handed_to_a_waiting_read_is_not_buffered() -> None:
    state = instance(subscription_bytes=4, subscriptions_bytes=4)
    sub = state.subscribe("t")
    handle = state.next_message(sub)
    publish(state, sub, "larger than the buffer")
    assert state.take(handle, "message") == "larger than the buffer"
    assert state.topics.buffered == 0 and state.topics.subscriptions[sub].dropped == 0


def test_one_overrun_per_loss_then_the_subscription_goes_on() -> None:
    state = instance(subscription_buffer=1)
    sub = state.subscribe("t")
    publish(state, sub, "a", "b")
    assert read(state, sub, 2) == ["overrun", "b"]
    publish(state, sub, "c")
    assert read(state, sub, 1) == ["c"]


def test_past_the_instance_bound_the_fullest_subscription_loses_its_oldest() -> None:
    state = instance(subscription_bytes=100, subscriptions_bytes=10)
    busy, quiet = state.subscribe("busy"), state.subscribe("quiet")
    publish(state, quiet, "qq")
    publish(state, busy, "1234", "5678")
    assert state.topics.buffered == 10
    publish(state, busy, "a")
    assert state.topics.buffered == 7
    assert read(state, quiet, 1) == ["qq"]
    assert read(state, busy, 3) == ["overrun", "5678", "a"]


def test_the_fullest_subscription_pays_until_the_instance_is_within_its_bound() -> None:
    state = instance(subscription_bytes=100, subscriptions_bytes=8)
    first, second = state.subscribe("first"), state.subscribe("second")
    publish(state, first, "1234")
    publish(state, second, "abc", "de")
    assert state.topics.buffered == 6
    publish(state, second, "fgh")
    assert (
        state.topics.subscriptions[first].dropped,
        state.topics.subscriptions[second].dropped,
    ) == (0, 2)
    assert state.topics.buffered == 7
    assert read(state, first, 1) == ["1234"]


def test_unsubscribing_gives_back_what_its_buffer_held() -> None:
    state = instance(subscriptions_bytes=8)
    first, second = state.subscribe("first"), state.subscribe("second")
    publish(state, first, "1234", "5678")
    state.unsubscribe(first)
    assert state.topics.buffered == 0
    publish(state, second, "abcdefgh")
    assert read(state, second, 1) == ["abcdefgh"]


def test_the_defaults_hold_1024_messages_16_mib_each_subscription_and_64_mib_in_all() -> None:
    state = instance()
    topics = state.topics
    assert (topics.messages, topics.subscription_bytes, topics.total_bytes) == (
        1024,
        16 << 20,
        64 << 20,
    )
