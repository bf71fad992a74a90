"""Released pages in the kv core: a context gives back the KV of full pages it no longer attends
to and keeps its tokens; the driver sees requests over the pages still held; an attention window
releases pages as a long generation goes, so its page count stays bounded."""

from __future__ import annotations

import random

import pytest

from pie.actors.kv.durable import SnapshotRecord
from pie.events import kv as ev
from pie.events.sampling import bools_to_rle, rle_to_bools
from tests.test_kv_core import PAGE, Kv, _assert_consistent, _churn_step, fast_decode, lane_pass

pytestmark = pytest.mark.unit

WINDOW = ev.AttentionWindow(sink_pages=1, window_pages=2)


def test_released_pages_go_back_to_the_pool_and_the_tokens_stay() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 14))
    before = kv.pages(context)
    kv.ok(ev.ReleasePages, context=context, pages=(1, 2))
    assert kv.pool.free == 32 - 2
    info = kv.describe(context)
    assert info.tokens == tuple(range(1, 14)) and info.positions == tuple(range(13))
    assert (info.pages, info.released_pages, info.masked_pages) == (2, (1, 2), (1, 2))
    request = kv.submit(context, [14])
    assert request.pages == (before[0], before[3])
    assert request.kv_start == 13 - 2 * PAGE and request.positions == (13,)
    assert request.masked_pages == ()
    assert kv.core.statistics().pages_released == 2


def test_other_masked_pages_are_renumbered_over_the_held_pages() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 22))
    kv.ok(ev.MaskPages, context=context, pages=(0, 4))
    kv.ok(ev.ReleasePages, context=context, pages=(1, 2))
    assert kv.submit(context, [5]).masked_pages == (0, 2)


def test_attention_masks_lose_the_slots_of_released_pages() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 13))
    kv.ok(ev.ReleasePages, context=context, pages=(1,))
    wanted = [i % 3 != 0 for i in range(13)]
    runs = bools_to_rle(wanted)
    request = kv.submit(context, [1], attention_masks=(runs,))
    assert request.attention_masks is not None
    assert rle_to_bools(request.attention_masks[0], 9) == wanted[:4] + wanted[8:]


@pytest.mark.parametrize(
    ("pages", "why"),
    [((3,), "0..2"), ((-1,), "0..2"), ((0, 5), "[5]")],
    ids=["the tail", "a negative index", "past the end"],
)
def test_only_full_written_pages_may_be_released(pages: tuple[int, ...], why: str) -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 14))
    failed = kv.refused(ev.ReleasePages, context=context, pages=pages)
    assert failed.kind == "invalid" and why in failed.message
    assert kv.describe(context).released_pages == () and kv.pool.free == 32 - 4


def test_pages_a_pass_in_flight_writes_cannot_be_released() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 6))
    flight = kv.submit(context, [6, 7, 8, 9])
    assert kv.refused(ev.ReleasePages, context=context, pages=(0,)).kind == "busy"
    kv.apply(flight)
    kv.ok(ev.ReleasePages, context=context, pages=(0, 1))


def test_a_released_page_cannot_be_shown_again_nor_become_a_tail() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 14))
    kv.ok(ev.ReleasePages, context=context, pages=(1,))
    failed = kv.refused(ev.MaskPages, context=context, pages=(1,), masked=False)
    assert "released" in failed.message
    failed = kv.refused(ev.TruncateContext, context=context, count=13 - 6)
    assert "page 1" in failed.message and len(kv.describe(context).tokens) == 13
    kv.ok(ev.TruncateContext, context=context, count=13 - 4)
    info = kv.describe(context)
    assert (len(info.tokens), info.released_pages, info.pages) == (4, (), 1)
    assert kv.pool.free == 32 - 1


def test_forks_and_snapshots_keep_the_release_and_share_only_held_pages() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 14))
    kv.ok(ev.ReleasePages, context=context, pages=(0, 1))
    child = kv.fork(context)
    kv.ok(ev.SaveContext, context=context, name="s")
    kv.ok(ev.DestroyContext, context=context)
    opened = int(kv.ok(ev.OpenContext, name="s").context)
    for ctx in (child, opened):
        assert kv.describe(ctx).released_pages == (0, 1)
    assert kv.pool.free == 32 - 2
    record = SnapshotRecord.of("local", "s", kv.core.snapshots[("local", "s")])
    assert SnapshotRecord.decode(record.encode()).released == (0, 1)
    for ctx in (child, opened):
        kv.ok(ev.DestroyContext, context=ctx)
    kv.ok(ev.DeleteSnapshot, name="s")
    assert kv.pool.free == 32


def test_records_from_before_releases_still_decode() -> None:
    old = b'{"user":"u","name":"n","tokens":[1],"positions":[0],"masked":[]}'
    assert SnapshotRecord.decode(old).released == ()


def test_a_window_keeps_the_sinks_and_the_last_pages_through_a_long_generation() -> None:
    kv = Kv(num_pages=8)
    context = kv.create()
    kv.write(context, range(1, 7))
    held = []
    for step in range(400):
        request = kv.submit(context, [step % 50], window=WINDOW)
        kv.apply(request)
        held.append(len(request.pages))
        _assert_consistent(kv)
    info = kv.describe(context)
    assert len(info.tokens) == 406 and max(held) == 3 and info.pages <= 3
    assert info.released_pages == tuple(range(1, 405 // PAGE - 1))
    assert kv.pool.free >= 8 - 3


def test_a_window_pass_starts_from_the_window_and_its_sinks() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 22))
    first = kv.pages(context)
    request = kv.submit(context, [1, 2, 3], window=ev.AttentionWindow(sink_pages=1, window_pages=3))
    assert request.pages[:3] == (first[0], first[3], first[4])
    assert request.kv_start == 21 - 2 * PAGE


@pytest.mark.parametrize(
    "window",
    [ev.AttentionWindow(sink_pages=-1, window_pages=2), ev.AttentionWindow(window_pages=0)],
)
def test_a_bad_window_is_refused(window: ev.AttentionWindow) -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 14))
    [(_, failed)] = kv.send(ev.SubmitForward, context=context, tokens=(1,), window=window)
    assert isinstance(failed, ev.RequestFailed) and failed.kind == "invalid"
    assert kv.describe(context).released_pages == ()


def test_a_windowed_lease_ends_with_the_tail_page_and_counts_held_slots() -> None:
    kv = Kv()
    context = kv.create()
    kv.write(context, range(1, 14))
    kv.reserve(context, 8)
    placed = fast_decode(kv, context, window=WINDOW)
    lease = placed.lease
    assert lease is not None
    assert lease.pages == placed.pages and lease.owned == 3
    assert lease.next_slot == 14 - PAGE and lease.next_position == 14
    kv.apply(placed)
    assert lane_pass(kv, lease, 7, page=lease.pages[-1]) == []
    assert kv.describe(context).tokens[-2:] == (6, 7)


@pytest.mark.parametrize("seed", range(3))
def test_a_churn_with_releases_and_windows_returns_every_page(seed: int) -> None:
    rng = random.Random(seed)
    kv = Kv(num_pages=24, vocab_size=3)
    saved: set[str] = set()
    flights: list = []
    for _ in range(400):
        contexts = list(kv.core.contexts)
        if contexts and rng.random() < 0.25:
            context = rng.choice(contexts)
            chain = kv.core.contexts[context]
            if rng.random() < 0.5:
                full = chain.written // PAGE
                pages = (rng.randrange(full),) if full else ()
                kv.send(ev.ReleasePages, context=context, pages=pages)
            else:
                window = ev.AttentionWindow(sink_pages=rng.randrange(2), window_pages=2)
                [(_, out)] = kv.send(ev.SubmitForward, context=context, tokens=(1,), window=window)
                if not isinstance(out, ev.RequestFailed):
                    flights.append(out.request)
        else:
            _churn_step(kv, rng, saved, flights)
        _assert_consistent(kv)
    for request in flights:
        kv.apply(request)
    for context in list(kv.core.contexts):
        kv.ok(ev.DestroyContext, context=context)
    for name in saved:
        kv.send(ev.DeleteSnapshot, name=name)
    assert kv.pool.free == 24


def test_only_the_owner_may_release_and_the_owner_is_served_after() -> None:
    kv = Kv()
    context = kv.create("a")
    kv.write(context, range(1, 14))
    failed = kv.refused(ev.ReleasePages, "b", context=context, pages=(0,))
    assert failed.kind == "not_owner" and kv.pool.free == 32 - 4
    [(_, failed)] = kv.send(ev.SubmitForward, "b", context=context, tokens=(1,), window=WINDOW)
    assert isinstance(failed, ev.RequestFailed) and failed.kind == "not_owner"
    assert kv.describe(context).released_pages == ()
    kv.ok(ev.ReleasePages, context=context, pages=(0, 1))
    assert kv.pool.free == 32 - 2


def test_a_sliding_window_model_releases_pages_that_left_every_window() -> None:
    """With a 6-token window (pages of 4), a pass starting at slot s reads back to s - 5: the
    context keeps the page holding s - 5 and what follows, whatever its length."""
    kv = Kv(sliding_window=6)
    context = kv.create()
    for token in range(40):
        request = kv.submit(context, [token])
        kv.apply(request)
        assert len([page for page in kv.pages(context) if page >= 0]) <= 3
        first_needed = max(token - 5, 0)
        assert request.kv_len - request.kv_start == 1
        assert request.kv_len >= token + 1 - first_needed  # every needed slot is still held
    info = kv.describe(context)
    assert info.tokens == tuple(range(40)) and len(info.released_pages) == 40 // PAGE - 3
    assert kv.core.statistics().pages_released == len(info.released_pages)


def test_a_sliding_window_model_reserves_no_more_than_its_window() -> None:
    kv = Kv(sliding_window=6)
    context = kv.create()
    kv.write(context, range(5))
    kv.reserve(context, 400)
    assert len(kv.pages(context)) + len(kv.core.contexts[context].reserved) == 3
    assert kv.pool.free == 32 - 3
