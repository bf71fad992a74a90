"""The bus core: queues hand each message to one puller in order, topics fan out to current
subscribers, and a full queue refuses with an overrun."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from pie.actors.bus import BusCore, BusStatistics
from pie.events import bus as ev
from pie.events.kv import Done, RequestFailed

pytestmark = pytest.mark.unit


class Bus:
    def __init__(self, max_queue: int = 10_000) -> None:
        self.core = BusCore(max_queue=max_queue)
        self._corr = itertools.count(1)

    def send(self, make: Any, requester: str, **fields: Any) -> list[tuple[str, Any]]:
        return self.core.handle(make(corr=next(self._corr), requester=requester, **fields))

    def push(self, queue: str, message: str, requester: str = "p") -> list[tuple[str, Any]]:
        return self.send(ev.Push, requester, queue=queue, message=message)

    def pulled(self, queue: str, requester: str = "c") -> list[str]:
        out = self.send(ev.Pull, requester, queue=queue)
        return [e.message for _, e in out if isinstance(e, ev.Pulled)]


def test_pulls_take_pushed_messages_in_order() -> None:
    bus = Bus()
    for message in ("one", "two", "three"):
        [(dst, reply)] = bus.push("q", message)
        assert dst == "p" and isinstance(reply, Done)
    assert [bus.pulled("q") for _ in range(3)] == [["one"], ["two"], ["three"]]


def test_queues_are_separate() -> None:
    bus = Bus()
    bus.push("a", "for a")
    bus.push("b", "for b")
    assert bus.pulled("b") == ["for b"] and bus.pulled("a") == ["for a"]


def test_a_waiting_pull_is_served_by_a_later_push() -> None:
    bus = Bus()
    assert bus.send(ev.Pull, "c", queue="q") == []
    out = bus.push("q", "late")
    assert out[0] == ("c", ev.Pulled(corr=1, queue="q", message="late"))
    assert out[1][0] == "p" and isinstance(out[1][1], Done)
    assert bus.core.statistics().queued_messages == 0


def test_waiting_pulls_are_served_in_the_order_they_came() -> None:
    bus = Bus()
    bus.send(ev.Pull, "first", queue="q")
    bus.send(ev.Pull, "second", queue="q")
    assert bus.push("q", "m1")[0][0] == "first"
    assert bus.push("q", "m2")[0][0] == "second"


def test_a_departed_puller_is_not_served() -> None:
    bus = Bus()
    bus.send(ev.Pull, "gone", queue="q")
    bus.send(ev.LeaveBus, "gone")
    bus.send(ev.Pull, "here", queue="q")
    assert bus.push("q", "m")[0][0] == "here"


def test_publish_reaches_every_subscriber_with_its_subscription_id() -> None:
    bus = Bus()
    [(_, first)] = bus.send(ev.Subscribe, "x", topic="news")
    [(_, second)] = bus.send(ev.Subscribe, "y", topic="news")
    bus.send(ev.Subscribe, "z", topic="sport")
    out = bus.send(ev.Publish, "x", topic="news", message="hello")
    delivered = {dst: e for dst, e in out if isinstance(e, ev.TopicMessage)}
    assert delivered == {
        "x": ev.TopicMessage(corr=first.corr, topic="news", sender="x", message="hello"),
        "y": ev.TopicMessage(corr=second.corr, topic="news", sender="x", message="hello"),
    }
    assert out[-1][0] == "x" and isinstance(out[-1][1], Done)


def test_unsubscribed_and_departed_subscribers_hear_nothing() -> None:
    bus = Bus()
    for who in ("stays", "unsubscribes", "leaves"):
        bus.send(ev.Subscribe, who, topic="t")
    bus.send(ev.Unsubscribe, "unsubscribes", topic="t")
    bus.send(ev.LeaveBus, "leaves")
    out = bus.send(ev.Publish, "p", topic="t", message="m")
    assert [dst for dst, e in out if isinstance(e, ev.TopicMessage)] == ["stays"]
    assert bus.core.statistics().subscriptions == 1


def test_publishing_to_a_topic_nobody_follows_only_acknowledges() -> None:
    bus = Bus()
    [(dst, reply)] = bus.send(ev.Publish, "p", topic="void", message="m")
    assert dst == "p" and isinstance(reply, Done)


def test_a_full_queue_refuses_with_an_overrun() -> None:
    bus = Bus(max_queue=2)
    bus.push("q", "1")
    bus.push("q", "2")
    [(dst, failed)] = bus.push("q", "3")
    assert dst == "p" and isinstance(failed, RequestFailed)
    assert failed.kind == "overrun" and "'q'" in failed.message
    assert bus.pulled("q") == ["1"]
    assert isinstance(bus.push("q", "3")[0][1], Done)


def test_statistics_count_queues_pulls_and_deliveries() -> None:
    bus = Bus()
    bus.push("q", "m")
    bus.send(ev.Pull, "c", queue="empty")
    bus.send(ev.Subscribe, "s", topic="t")
    bus.send(ev.Publish, "p", topic="t", message="m")
    stats = bus.core.statistics()
    assert (stats.queued_messages, stats.waiting_pulls) == (1, 1)
    assert (stats.topics, stats.subscriptions) == (1, 1)
    assert stats.delivered == 1


def test_every_reply_carries_the_corr_of_its_command() -> None:
    core = BusCore(max_queue=1)
    assert core.handle(ev.Subscribe(corr=11, requester="s", topic="t")) == [("s", Done(corr=11))]
    assert core.handle(ev.Publish(corr=12, requester="p", topic="t", message="m"))[-1] == (
        "p",
        Done(corr=12),
    )
    assert core.handle(ev.Push(corr=13, requester="p", queue="q", message="a")) == [
        ("p", Done(corr=13))
    ]
    [(_, full)] = core.handle(ev.Push(corr=14, requester="p", queue="q", message="b"))
    assert isinstance(full, RequestFailed) and full.corr == 14
    assert core.handle(ev.Pull(corr=15, requester="c", queue="q")) == [
        ("c", ev.Pulled(corr=15, queue="q", message="a"))
    ]
    assert core.handle(ev.Pull(corr=16, requester="c", queue="q")) == []
    assert core.handle(ev.Push(corr=17, requester="p", queue="q", message="c")) == [
        ("c", ev.Pulled(corr=16, queue="q", message="c")),
        ("p", Done(corr=17)),
    ]
    assert core.handle(ev.Unsubscribe(corr=18, requester="s", topic="t")) == [("s", Done(corr=18))]
    assert core.handle(ev.LeaveBus(corr=19, requester="s")) == [("s", Done(corr=19))]


def test_leaving_or_unsubscribing_without_a_subscription_is_acknowledged() -> None:
    bus = Bus()
    bus.send(ev.Subscribe, "other", topic="t")
    for make, fields in [
        (ev.Unsubscribe, {"topic": "t"}),
        (ev.Unsubscribe, {"topic": "nobody follows this"}),
        (ev.LeaveBus, {}),
    ]:
        [(dst, reply)] = bus.send(make, "stranger", **fields)
        assert dst == "stranger" and isinstance(reply, Done)
    assert bus.core.statistics().subscriptions == 1


def test_a_queue_holds_ten_thousand_messages_by_default() -> None:
    bus = Bus(max_queue=BusCore().max_queue)
    for i in range(10_000):
        bus.push("q", str(i))
    [(_, failed)] = bus.push("q", "one too many")
    assert isinstance(failed, RequestFailed) and failed.kind == "overrun"


def test_delivered_counts_every_message_handed_to_a_receiver() -> None:
    bus = Bus()
    for who in ("x", "y"):
        bus.send(ev.Subscribe, who, topic="t")
    bus.send(ev.Publish, "p", topic="t", message="first")
    bus.push("q", "queued")
    bus.pulled("q")
    bus.send(ev.Pull, "c", queue="q")
    bus.push("q", "to a waiting pull")
    bus.send(ev.Publish, "p", topic="t", message="second")
    bus.push("q", "left in the queue")
    assert bus.core.statistics() == BusStatistics(
        queues=1,
        queued_messages=1,
        waiting_pulls=0,
        topics=1,
        subscriptions=2,
        delivered=6,
    )


def test_an_unknown_event_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="unexpected event object"):
        BusCore().handle(object())
