"""Page quotas in the kv core: an inferlet, a user's contexts and a user's snapshots each hold at
most their share of the pool; the one over its quota is refused (out_of_pages, too_large,
snapshot_quota) and changes nothing, while everyone else is still served."""

from __future__ import annotations

import pytest

from pie.actors.kv import Quotas
from pie.actors.kv.context import Chain
from pie.actors.kv.pages import OutOfPages
from pie.actors.kv.quotas import check_growth
from pie.events import kv as ev
from tests.test_kv_core import PAGE, Kv

pytestmark = pytest.mark.unit


def quota_kv(inferlet: int = 4, user: int = 6, snapshots: int = 3, pages: int = 16) -> Kv:
    return Kv(num_pages=pages, quotas=Quotas(inferlet=inferlet, user=user, snapshots=snapshots))


def tokens(pages: int, start: int = 1) -> list[int]:
    return [start + i % 50 for i in range(pages * PAGE)]


def test_an_inferlet_over_its_quota_is_out_of_pages_and_changes_nothing() -> None:
    kv = quota_kv(inferlet=4, user=8)
    first, second = kv.create("hog"), kv.create("hog")
    kv.write(first, tokens(3), "hog")
    kv.write(second, [1], "hog")
    before = kv.core.state()
    refused = kv.refused(ev.SubmitForward, "hog", context=second, tokens=tuple(tokens(1)))
    assert refused.kind == "out_of_pages" and "quota is 4" in refused.message
    assert kv.core.state() == before
    other = kv.create("good")
    kv.write(other, tokens(4, start=60), "good")
    assert len(kv.pages(other)) == 4


def test_the_pages_an_inferlet_can_still_take_are_its_quota_less_what_it_holds() -> None:
    kv = quota_kv()
    context = kv.create("a")
    kv.write(context, tokens(3))
    kv.write(context, tokens(1, start=70))
    assert len(kv.pages(context)) == 4
    assert kv.refused(ev.SubmitForward, "a", context=context, tokens=(5,)).kind == "too_large"


def test_a_user_over_its_quota_is_out_of_pages_while_another_user_is_served() -> None:
    kv = quota_kv(inferlet=4, user=6)
    one, two = kv.create("a1", user="ann"), kv.create("a2", user="ann")
    kv.write(one, tokens(4), "a1")
    kv.write(two, tokens(2, start=60), "a2")
    refused = kv.refused(ev.SubmitForward, "a2", context=two, tokens=tuple(tokens(1)))
    assert refused.kind == "out_of_pages" and "user 'ann'" in refused.message
    bob = kv.create("b", user="bob")
    kv.write(bob, tokens(4, start=30), "b")


def test_forks_count_their_shared_pages_once() -> None:
    kv = quota_kv(inferlet=4)
    context = kv.create()
    kv.write(context, tokens(3))
    forks = [kv.fork(context) for _ in range(5)]
    kv.write(forks[0], tokens(1, start=80))
    assert len(kv.pages(forks[0])) == 4


def test_a_context_larger_than_a_quota_is_too_large_and_not_out_of_pages() -> None:
    kv = quota_kv(inferlet=4, user=6)
    context = kv.create()
    refused = kv.refused(ev.SubmitForward, context=context, tokens=tuple(tokens(5)))
    assert refused.kind == "too_large" and "at most 4" in refused.message
    assert kv.pool.free == 16
    kv.write(context, tokens(4))


def test_a_prompt_larger_than_the_whole_pool_is_too_large() -> None:
    kv = Kv(num_pages=4)
    context = kv.create()
    refused = kv.refused(ev.SubmitForward, context=context, tokens=tuple(tokens(5)))
    assert refused.kind == "too_large"
    kv.write(context, tokens(4))


def test_a_reservation_over_the_quota_is_out_of_pages_and_reserves_nothing() -> None:
    kv = quota_kv(inferlet=4)
    context = kv.create()
    kv.write(context, tokens(1))
    assert kv.refused(ev.ReserveTokens, context=context, count=4 * PAGE).kind == "out_of_pages"
    assert kv.describe(context).reserved_pages == 0
    assert kv.reserve(context, 3 * PAGE) != []


def test_reserved_pages_count_against_the_quota() -> None:
    kv = quota_kv(inferlet=4)
    held = kv.create()
    kv.reserve(held, 3 * PAGE)
    other = kv.create()
    kv.write(other, tokens(1))
    assert kv.refused(ev.SubmitForward, context=other, tokens=tuple(tokens(1))).kind == (
        "out_of_pages"
    )


def save(kv: Kv, requester: str, user: str, name: str, pages: int, start: int) -> None:
    context = kv.create(requester, user=user)
    kv.write(context, tokens(pages, start), requester)
    kv.ok(ev.SaveContext, requester, context=context, name=name, user=user)
    kv.ok(ev.DestroyContext, requester, context=context)


def test_snapshots_over_the_users_quota_are_refused_and_others_still_save() -> None:
    kv = quota_kv(snapshots=3)
    save(kv, "a", "ann", "one", 2, start=1)
    context = kv.create("a", user="ann")
    kv.write(context, tokens(2, start=40), "a")
    refused = kv.refused(ev.SaveContext, "a", context=context, name="two", user="ann")
    assert refused.kind == "snapshot_quota" and "quota is 3" in refused.message
    assert ("ann", "two") not in kv.core.snapshots
    save(kv, "b", "bob", "one", 3, start=60)
    kv.ok(ev.DeleteSnapshot, "a", name="one", user="ann")
    kv.ok(ev.SaveContext, "a", context=context, name="two", user="ann")


def test_snapshots_sharing_pages_count_them_once() -> None:
    kv = quota_kv(snapshots=3)
    context = kv.create()
    kv.write(context, tokens(3))
    for name in ("x", "y", "z"):
        kv.ok(ev.SaveContext, context=context, name=name)
    assert len(kv.core.snapshots) == 3


def test_dropping_a_users_snapshots_frees_their_pages_and_keeps_the_others() -> None:
    kv = quota_kv(snapshots=3)
    save(kv, "a", "ann", "one", 1, start=1)
    save(kv, "a", "ann", "two", 2, start=20)
    save(kv, "b", "bob", "one", 1, start=40)
    kv.ok(ev.DropSnapshots, "operator", user="ann")
    assert list(kv.core.snapshots) == [("bob", "one")]
    assert kv.pool.free == 16 - 1
    kv.ok(ev.OpenContext, "b", name="one", user="bob")


def test_shares_become_pages_of_at_least_one_and_must_lie_in_zero_to_one() -> None:
    quotas = Quotas.shares(10, inferlet=0.5, user=0.75, snapshots=0.01)
    assert (quotas.inferlet, quotas.user, quotas.snapshots, quotas.context) == (5, 7, 1, 5)
    assert Quotas.shares(10, inferlet=1.0, user=1.0, snapshots=1.0).context == 10
    with pytest.raises(ValueError):
        Quotas.shares(10, inferlet=0.0, user=1.0, snapshots=1.0)
    with pytest.raises(ValueError):
        Quotas.shares(10, inferlet=1.0, user=1.5, snapshots=1.0)


def test_holdings_are_counted_once_the_pool_in_use_could_reach_a_quota() -> None:
    quotas = Quotas(inferlet=4, user=6, snapshots=3)
    hog = Chain(owner="a", pages=[0, 1, 2])
    # What the pool holds bounds what anyone holds: 1 page in use and 2 new ones fit.
    check_growth(quotas, [hog], hog, 2, in_use=1)
    # With the true count the holder is over its quota, and is refused.
    with pytest.raises(OutOfPages):
        check_growth(quotas, [hog], hog, 2, in_use=3)
    # At the bound exactly the holdings are not counted; one page past it they are.
    check_growth(quotas, [hog], hog, 2, in_use=2)
    with pytest.raises(OutOfPages):
        check_growth(quotas, [hog], hog, 2, attached=[9], in_use=2)
