"""The bus core: queues hand each message to one puller in order, topics fan out to current
subscribers, and a full queue refuses with an overrun."""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import pytest

from pie.actors.bus import BusCore, BusLimits, BusStatistics
from pie.actors.bus.core import MESSAGE_OVERHEAD
from pie.events import bus as ev
from pie.events.kv import Done, RequestFailed

pytestmark = pytest.mark.unit


class Bus:
    def __init__(self, max_queue: int = 10_000, **limits: int) -> None:
        self.core = BusCore(BusLimits(max_queue_messages=max_queue, **limits))
        self._corr = itertools.count(1)

    def send(self, make: Any, requester: str, **fields: Any) -> list[tuple[str, Any]]:
        return self.core.handle(make(corr=next(self._corr), requester=requester, **fields))

    def push(
        self, queue: str, message: str, requester: str = "p", user: str = ""
    ) -> list[tuple[str, Any]]:
        return self.send(ev.Push, requester, queue=queue, message=message, user=user)

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
    core = BusCore(BusLimits(max_queue_messages=1))
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
    bus = Bus(max_queue=BusCore().limits.max_queue_messages)
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
        queued_bytes=len("left in the queue") + MESSAGE_OVERHEAD,
        waiting_pulls=0,
        topics=1,
        subscriptions=2,
        requesters=2,
        delivered=6,
    )


def test_an_unknown_event_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="unexpected event object"):
        BusCore().handle(object())


def refusal(out: list[tuple[str, Any]], requester: str = "p") -> RequestFailed:
    [(dst, failed)] = out
    assert dst == requester and isinstance(failed, RequestFailed)
    return failed


def test_a_message_over_the_size_bound_is_refused_too_large_even_to_a_waiting_pull() -> None:
    bus = Bus(max_message_bytes=4)
    bus.send(ev.Pull, "c", queue="q")
    failed = refusal(bus.push("q", "12345"))
    assert failed.kind == "too-large" and "5 bytes" in failed.message
    [(dst, pulled)] = [o for o in bus.push("q", "1234") if isinstance(o[1], ev.Pulled)]
    assert (dst, pulled.message) == ("c", "1234")


def test_a_message_is_measured_in_utf8_bytes() -> None:
    bus = Bus(max_message_bytes=4)
    assert refusal(bus.push("q", "ééé")).kind == "too-large"
    assert isinstance(bus.push("q", "éé")[0][1], Done)
    assert bus.core.statistics().queued_bytes == 4 + MESSAGE_OVERHEAD


def test_a_broadcast_over_the_size_bound_reaches_no_subscriber() -> None:
    bus = Bus(max_message_bytes=4)
    bus.send(ev.Subscribe, "s", topic="t")
    assert refusal(bus.send(ev.Publish, "p", topic="t", message="12345")).kind == "too-large"
    assert [dst for dst, _ in bus.send(ev.Publish, "p", topic="t", message="1234")] == ["s", "p"]


def test_a_queue_over_its_byte_bound_refuses_with_an_overrun_and_others_still_take() -> None:
    bus = Bus(max_queue_bytes=2 * (MESSAGE_OVERHEAD + 10))
    bus.push("q", "x" * 10)
    bus.push("q", "x" * 10)
    failed = refusal(bus.push("q", "x"))
    assert failed.kind == "overrun" and "'q'" in failed.message
    assert isinstance(bus.push("other", "x" * 10)[0][1], Done)
    bus.pulled("q")
    assert isinstance(bus.push("q", "x" * 10)[0][1], Done)


def test_a_user_over_its_byte_bound_gets_quota_while_another_user_is_served() -> None:
    bus = Bus(max_user_bytes=2 * (MESSAGE_OVERHEAD + 10))
    bus.push("a", "x" * 10, requester="hog:1", user="hog")
    bus.push("b", "x" * 10, requester="hog:2", user="hog")
    failed = refusal(bus.push("c", "x", requester="hog:3", user="hog"), "hog:3")
    assert failed.kind == "quota" and "'hog'" in failed.message
    assert isinstance(bus.push("c", "x" * 10, user="good")[0][1], Done)
    assert bus.pulled("a") == ["x" * 10]
    assert isinstance(bus.push("c", "x" * 10, requester="hog:3", user="hog")[0][1], Done)


def test_without_a_user_the_requester_is_charged_as_its_own_user() -> None:
    bus = Bus(max_user_bytes=MESSAGE_OVERHEAD + 1)
    bus.push("q", "x", requester="p1")
    assert refusal(bus.push("q", "x", requester="p1"), "p1").kind == "quota"
    assert isinstance(bus.push("q", "x", requester="p2")[0][1], Done)


def test_a_message_handed_to_a_waiting_pull_is_not_charged() -> None:
    bus = Bus(max_user_bytes=MESSAGE_OVERHEAD + 1)
    for _ in range(3):
        bus.send(ev.Pull, "c", queue="q")
        assert isinstance(bus.push("q", "x", user="u")[-1][1], Done)
    assert bus.core.statistics().queued_bytes == 0


def test_pulling_gives_back_what_the_message_was_charged() -> None:
    bus = Bus(max_user_bytes=MESSAGE_OVERHEAD + 1)
    for _ in range(3):
        assert isinstance(bus.push("q", "x", user="u")[0][1], Done)
        assert bus.pulled("q") == ["x"]
    assert bus.core.statistics().queued_bytes == 0


def test_the_default_bounds_refuse_a_64_mib_message() -> None:
    bus = Bus()
    assert refusal(bus.push("q", "x" * (64 << 20))).kind == "too-large"
    assert bus.core.statistics().queued_bytes == 0 and bus.core.names() == 0


def test_a_broadcast_nobody_follows_is_not_kept() -> None:
    bus = Bus()
    for i in range(100):
        bus.send(ev.Publish, "p", topic=f"void{i}", message="m" * 1000)
    assert bus.core.names() == 0 and bus.core.statistics().queued_bytes == 0


def test_a_queue_name_is_forgotten_once_its_last_message_is_pulled() -> None:
    bus = Bus()
    bus.push("q", "m")
    assert bus.core.names() == 1
    bus.pulled("q")
    assert bus.core.names() == 0


def test_a_queue_name_is_forgotten_once_its_waiting_pull_is_served() -> None:
    bus = Bus()
    bus.send(ev.Pull, "c", queue="q")
    bus.send(ev.Pull, "c", queue="q")
    bus.push("q", "m1")
    assert bus.core.names() == 1
    bus.push("q", "m2")
    assert bus.core.names() == 0
    assert bus.core.statistics().requesters == 0


def test_a_topic_name_is_forgotten_with_its_last_subscriber() -> None:
    bus = Bus()
    bus.send(ev.Subscribe, "a", topic="t")
    bus.send(ev.Subscribe, "b", topic="t")
    bus.send(ev.Unsubscribe, "a", topic="t")
    assert bus.core.names() == 1
    bus.send(ev.Unsubscribe, "b", topic="t")
    assert bus.core.names() == 0
    assert bus.core.statistics().requesters == 0


def test_leaving_forgets_the_names_only_the_leaver_held() -> None:
    bus = Bus()
    bus.send(ev.Subscribe, "gone", topic="mine")
    bus.send(ev.Subscribe, "gone", topic="shared")
    bus.send(ev.Subscribe, "stays", topic="shared")
    bus.send(ev.Pull, "gone", queue="waited")
    bus.push("parked", "m", requester="gone")
    bus.send(ev.LeaveBus, "gone")
    stats = bus.core.statistics()
    assert bus.core.names() == 2  # "shared" (still followed) and "parked" (still holds a message)
    assert (stats.topics, stats.waiting_pulls, stats.queued_messages) == (1, 0, 1)
    assert stats.requesters == 1
    assert bus.pulled("parked") == ["m"]
    assert [dst for dst, _ in bus.send(ev.Publish, "p", topic="shared", message="m")] == [
        "stays",
        "p",
    ]


def test_a_forgotten_name_starts_afresh_when_used_again() -> None:
    bus = Bus()
    bus.send(ev.Subscribe, "old", topic="t")
    bus.send(ev.Unsubscribe, "old", topic="t")
    bus.send(ev.Subscribe, "new", topic="t")
    delivered = [dst for dst, e in bus.send(ev.Publish, "p", topic="t", message="m")]
    assert delivered == ["new", "p"]


def test_after_a_churn_of_names_the_tables_return_to_their_baseline() -> None:
    bus = Bus()
    bus.send(ev.Subscribe, "resident", topic="lobby")
    baseline = (bus.core.names(), bus.core.statistics())
    for i in range(2000):
        who = f"inferlet:{i}"
        bus.send(ev.Subscribe, who, topic=f"topic{i}")
        bus.send(ev.Subscribe, who, topic="lobby")
        bus.send(ev.Pull, who, queue=f"inbox{i}")
        bus.push(f"box{i}", "m", requester=who)
        bus.pulled(f"box{i}", requester="resident")
        if i % 2:
            bus.send(ev.Unsubscribe, who, topic=f"topic{i}")
        bus.send(ev.LeaveBus, who)
    stats = bus.core.statistics()
    assert bus.core.names() == baseline[0]
    assert attrs.evolve(stats, delivered=0) == attrs.evolve(baseline[1], delivered=0)


def test_a_requester_over_its_waiting_pulls_gets_an_overrun_while_others_wait() -> None:
    bus = Bus(max_waiting_pulls=2)
    assert bus.send(ev.Pull, "hog", queue="a") == []
    assert bus.send(ev.Pull, "hog", queue="b") == []
    failed = refusal(bus.send(ev.Pull, "hog", queue="a"), "hog")
    assert failed.kind == "overrun" and failed.corr == 3
    assert "hog" in failed.message and "max_waiting_pulls" in failed.message
    assert bus.send(ev.Pull, "good", queue="a") == []
    assert bus.core.statistics().waiting_pulls == 3
    assert [dst for dst, _ in bus.push("a", "m1")] == ["hog", "p"]
    assert [dst for dst, _ in bus.push("a", "m2")] == ["good", "p"]


def test_a_served_pull_makes_room_for_another() -> None:
    bus = Bus(max_waiting_pulls=1)
    bus.send(ev.Pull, "c", queue="q")
    bus.push("q", "m")
    assert bus.send(ev.Pull, "c", queue="q") == []


def test_a_pull_a_message_answers_at_once_needs_no_room() -> None:
    bus = Bus(max_waiting_pulls=1)
    bus.send(ev.Pull, "c", queue="empty")
    bus.push("full", "m")
    assert bus.pulled("full") == ["m"]


def test_a_refused_pull_leaves_nothing_behind() -> None:
    bus = Bus(max_waiting_pulls=1)
    bus.send(ev.Pull, "c", queue="q")
    bus.send(ev.Pull, "c", queue="other")
    assert bus.core.names() == 1 and bus.core.statistics().waiting_pulls == 1
    bus.send(ev.LeaveBus, "c")
    assert bus.core.names() == 0 and bus.core.statistics().requesters == 0


def test_a_requester_waits_on_at_most_a_thousand_and_twenty_four_pulls_by_default() -> None:
    bus = Bus()
    for n in range(1024):
        assert bus.send(ev.Pull, "c", queue=f"q{n % 3}") == []
    assert refusal(bus.send(ev.Pull, "c", queue="q0"), "c").kind == "overrun"


def test_the_core_says_which_queues_pulls_wait_on_and_how_many() -> None:
    bus = Bus()
    bus.send(ev.Pull, "first", queue="q")
    bus.send(ev.Pull, "second", queue="q")
    bus.send(ev.Pull, "third", queue="r")
    assert (bus.core.waiting("q"), bus.core.waiting("r"), bus.core.waiting("s")) == (2, 1, 0)
    assert sorted(bus.core.waited_queues()) == ["q", "r"]
    bus.push("r", "served")
    bus.send(ev.LeaveBus, "first")
    assert bus.core.waiting("q") == 1 and bus.core.waited_queues() == ["q"]
