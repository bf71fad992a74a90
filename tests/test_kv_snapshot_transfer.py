"""The kv core's part in copying a named snapshot between nodes, driven directly: lending a
snapshot's pages (pinned until the lease is released), placing imported tokens as a pass would
(committed like one, or rolled back), and a clustered core handing snapshots it lacks to the
directory."""

from __future__ import annotations

import pytest

from pie.actors.kv import KvCore
from pie.events import kv as ev
from pie.events.speculation import LeaseReleased
from tests.test_kv_core import PAGE, Kv

pytestmark = pytest.mark.unit

TOKENS = tuple(range(10, 20))
"""Two full pages of 4 and a partial one."""


def saved(kv: Kv, name: str = "plan", user: str = "ada") -> int:
    context = kv.create(user=user)
    kv.write(context, TOKENS)
    kv.ok(ev.SaveContext, context=context, name=name, user=user)
    return context


def test_a_lent_snapshot_keeps_its_pages_pinned_until_the_lease_is_released() -> None:
    kv = Kv()
    kv.ok(ev.DestroyContext, context=saved(kv))
    lent = kv.ok(ev.LendSnapshot, name="plan", user="ada")
    snapshot = kv.core.snapshots[("ada", "plan")]
    assert (lent.tokens, lent.pages, lent.plain) == (TOKENS, tuple(snapshot.pages), True)
    assert lent.positions == tuple(range(10))
    kv.ok(ev.DeleteSnapshot, name="plan", user="ada")
    assert kv.pool.free == 32 - 3, "deleted, but pinned by the lease"
    kv.core.handle(LeaseReleased(lease=lent.lease, context=0))
    assert kv.pool.free == 32 and kv.core.leases == {}


def test_lending_what_the_user_does_not_hold_or_what_is_more_than_tokens() -> None:
    kv = Kv()
    context = saved(kv)
    assert kv.refused(ev.LendSnapshot, name="plan", user="bob").kind == "no_such_snapshot"
    kv.ok(ev.MaskPages, context=context, pages=(0,))
    kv.ok(ev.SaveContext, context=context, name="masked", user="ada")
    assert kv.ok(ev.LendSnapshot, name="masked", user="ada").plain is False


def test_imported_pages_commit_under_the_hashes_a_computed_pass_gives_them() -> None:
    computed, imported = Kv(), Kv()
    computed.write(computed.create(user="ada"), TOKENS)
    context = imported.create(user="ada")
    placed = imported.ok(ev.ImportPages, context=context, tokens=TOKENS, positions=tuple(range(10)))
    assert placed.kv_start == 0 and len(placed.pages) == 3
    imported.core.handle(ev.PassApplied(corr=placed.corr, context=context, ok=True))
    [ours] = computed.core.contexts.values()
    assert imported.core.contexts[context].hashes == ours.hashes and len(ours.hashes) == 2
    # The same tokens again: the prefix cache finds the committed pages, written already.
    again = imported.create(user="ada")
    second = imported.ok(ev.ImportPages, context=again, tokens=TOKENS, positions=tuple(range(10)))
    assert second.kv_start == 2 * PAGE and second.pages[:2] == placed.pages[:2]


def test_a_failed_import_leaves_no_page_and_only_an_empty_context_takes_one() -> None:
    kv = Kv()
    context = kv.create()
    placed = kv.ok(ev.ImportPages, context=context, tokens=TOKENS, positions=tuple(range(10)))
    kv.core.handle(ev.PassApplied(corr=placed.corr, context=context, ok=False))
    assert kv.pool.free == 32 and kv.describe(context).tokens == ()
    kv.write(context, [1])
    refused = kv.refused(ev.ImportPages, context=context, tokens=(2,), positions=(1,))
    assert refused.kind == "invalid" and "empty context" in refused.message


def test_a_clustered_core_hands_the_snapshots_it_lacks_to_the_directory() -> None:
    kv = Kv()
    kv.core = KvCore(num_pages=32, page_size=PAGE, vocab_size=100, directory="kv.directory")
    [(dst, missing)] = kv.send(ev.OpenContext, name="plan", user="ada", take=True)
    [(_, deleted)] = kv.send(ev.DeleteSnapshot, name="plan", user="ada")
    lend = kv.refused(ev.LendSnapshot, name="plan", user="ada")
    assert dst == "kv.directory" and isinstance(missing, ev.SnapshotMissing)
    assert (missing.requester, missing.name, missing.user, missing.take) == (
        "a",
        "plan",
        "ada",
        True,
    )
    assert missing.message == "no snapshot named 'plan'" and not missing.delete
    assert isinstance(deleted, ev.SnapshotMissing) and deleted.delete
    assert lend.kind == "no_such_snapshot", "a lend is answered here: the holder has none"
