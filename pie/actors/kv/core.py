"""The kv actor's pure core: every context command in, placed passes and replies out.

No trio here: `handle(event)` returns (destination, event) pairs, so tests and replay drive it
directly. This module dispatches and keeps the contexts' lifecycle; passes.py places and settles
passes, state.py holds the pool, the chains and the page edits they share.
"""

from __future__ import annotations

from typing import Any

from pie.actors.kv.context import RELEASED, Chain
from pie.actors.kv.pages import OutOfPages
from pie.actors.kv.passes import PassPlacement
from pie.actors.kv.quotas import check_growth, check_snapshot
from pie.actors.kv.state import Output
from pie.actors.kv.statistics import KvStatistics
from pie.actors.kv.validation import RequestError
from pie.actors.kv.window import check_release
from pie.events import kv as ev
from pie.events.batching import ScheduleForward
from pie.events.speculation import LanePassApplied, LanePassesApplied, LeaseReleased

__all__ = ["KvCore", "KvStatistics", "Output"]


class KvCore(PassPlacement):
    accepts = (ev.KvCommand, LanePassApplied, LanePassesApplied, LeaseReleased)
    """The kv mailbox: context commands, and the commits of passes run on the fast path."""

    def handle(self, event: Any) -> list[Output]:
        try:
            return self._dispatch(event)
        except RequestError as err:
            if (
                err.kind == "no_such_snapshot"
                and self.directory is not None
                and isinstance(event, ev.OpenContext | ev.DeleteSnapshot)
            ):
                return [(self.directory, _missing(event, str(err)))]
            return [
                (
                    event.requester,
                    ev.RequestFailed(corr=event.corr, kind=err.kind, message=str(err)),
                )
            ]
        except OutOfPages as err:
            failed = ev.RequestFailed(corr=event.corr, kind="out_of_pages", message=str(err))
            return [(event.requester, failed)]

    def _dispatch(self, event: Any) -> list[Output]:
        match event:
            case ev.SubmitForward():
                return [(self.data_plane, ScheduleForward(request=self._place(event)))]
            case ev.PassApplied():
                self._settle(event)
                return []
            case LanePassApplied():
                self._lane_pass(event)
                return []
            case LanePassesApplied():
                for applied in event.passes:
                    self._lane_pass(applied)
                return []
            case LeaseReleased():
                self.pool.unpin(self.leases.pop(event.lease, ()))
                return []
            case ev.CreateContext():
                salt = self.prefix.first_salt(event.user)
                chain = Chain(owner=event.requester, user=event.user, salt=salt)
                return self._created(event, chain)
            case ev.ForkContext():
                source = self._owned(event.context, event.requester)
                self._quiet(source, "fork")
                source.lease = None
                self.pool.share(source.held())
                return self._created(event, source.copy(event.requester))
            case ev.OpenContext():
                return self._open(event)
            case ev.SaveContext():
                return self._save(event)
            case ev.DeleteSnapshot():
                self._snapshot((event.user, event.name))
                self._delete_snapshot((event.user, event.name))
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.DropSnapshots():
                for key in [k for k in self.snapshots if k[0] == event.user]:
                    self._delete_snapshot(key)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.DestroyContext():
                self._owned(event.context, event.requester)
                self._drop(event.context)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.TruncateContext():
                self._truncate(self._owned(event.context, event.requester), event.count)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.ReserveTokens():
                self._reserve(self._owned(event.context, event.requester), event.count)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.MaskPages():
                self._mask(self._owned(event.context, event.requester), event.pages, event.masked)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.ReleasePages():
                chain = self._owned(event.context, event.requester)
                self._quiet(chain, "release pages of")
                check_release(chain, event.pages, self.page_size)
                self._release(chain, event.pages)
                return [(event.requester, ev.Done(corr=event.corr))]
            case ev.DescribeContext():
                return [(event.requester, self._describe(event))]
            case ev.LendSnapshot():
                return [(event.requester, self._lend(event))]
            case ev.ImportPages():
                return [(event.requester, self._import(event))]
            case ev.ReleaseRequester():
                for context in [
                    c for c, ch in self.contexts.items() if ch.owner == event.requester
                ]:
                    self._drop(context)
                return [(event.requester, ev.Done(corr=event.corr))] if event.reply else []
        raise TypeError(f"kv actor got an unexpected event {type(event).__name__}")

    def _created(self, event: Any, chain: Chain) -> list[Output]:
        context = self._next_context
        self._next_context += self._context_step
        self.contexts[context] = chain
        return [(event.requester, ev.ContextCreated(corr=event.corr, context=context))]

    def _open(self, event: ev.OpenContext) -> list[Output]:
        key = (event.user, event.name)
        snapshot = self._snapshot(key)
        if event.take:
            del self.snapshots[key]
            snapshot.owner = event.requester
            return self._created(event, snapshot)
        self.pool.share(snapshot.held())
        return self._created(event, snapshot.copy(event.requester))

    def _save(self, event: ev.SaveContext) -> list[Output]:
        chain = self._owned(event.context, event.requester)
        self._quiet(chain, "save")
        chain.lease = None
        key = (event.user, event.name)
        if key in self.snapshots:
            raise RequestError("snapshot_exists", f"a snapshot named {event.name!r} exists")
        snapshot = chain.copy(owner=f"snapshot:{event.user}")
        snapshot.user = event.user
        check_snapshot(self.quotas, self.snapshots.values(), snapshot)
        self.pool.share(chain.held())
        self.snapshots[key] = snapshot
        return [(event.requester, ev.Done(corr=event.corr))]

    def _lend(self, event: ev.LendSnapshot) -> ev.SnapshotLent:
        snapshot = self._snapshot((event.user, event.name))
        pages = snapshot.held()
        lease = self._next_lease
        self._next_lease += 1
        self.pool.pin(pages)
        self.leases[lease] = pages
        plain = not (
            snapshot.masked or snapshot.adapter_runs or snapshot.mask_runs or snapshot.media_runs
        )
        return ev.SnapshotLent(
            corr=event.corr,
            lease=lease,
            tokens=tuple(snapshot.tokens),
            positions=tuple(snapshot.positions),
            pages=tuple(pages),
            plain=plain,
        )

    def _import(self, event: ev.ImportPages) -> ev.PagesPlaced:
        # Placed as a pass without slots: the same checks, pages, prefix reuse and commit.
        chain = self._owned(event.context, event.requester)
        if chain.tokens:
            raise RequestError("invalid", "pages are imported into an empty context only")
        submit = ev.SubmitForward(
            corr=event.corr,
            requester=event.requester,
            context=event.context,
            tokens=event.tokens,
            positions=event.positions,
        )
        request = self._place(submit)
        return ev.PagesPlaced(corr=event.corr, pages=request.pages, kv_start=request.kv_start)

    def _delete_snapshot(self, key: tuple[str, str]) -> None:
        self._release_chain(self.snapshots.pop(key).held())

    def _drop(self, context: int) -> None:
        chain = self.contexts.pop(context)
        self._release_chain(chain.held())
        self.pool.release(chain.reserved)

    def _reserve(self, chain: Chain, count: int) -> None:
        # A pass in flight is no obstacle: it already holds its pages, and the pages it took
        # from the reserve go back to the reserve's front if it fails. A copied tail needs one
        # fresh page more.
        if count < 0:
            raise RequestError("invalid", f"cannot reserve {count} tokens")
        length = len(chain.tokens)
        copy = 1 if count and self._tail_needing_copy(chain, length) is not None else 0
        wanted = self._pages_for(length + count) + copy - len(chain.pages) - len(chain.reserved)
        if self.model_window is not None:
            # On a sliding-window model a context holds at most its window: a reserve for a
            # whole generation would pin pages the context gives back as it goes.
            room = self.model_window.window_pages + copy
            wanted = min(wanted, room - len(chain.held()) - len(chain.reserved))
        self.pool.check_room(wanted)
        check_growth(self.quotas, self.contexts.values(), chain, wanted, in_use=self.pool.in_use)
        chain.reserved.extend(self.pool.allocate(max(wanted, 0)))

    def _truncate(self, chain: Chain, count: int) -> None:
        self._quiet(chain, "truncate")
        chain.lease = None
        if not 0 <= count <= len(chain.tokens):
            raise RequestError("invalid", f"cannot truncate {count} of {len(chain.tokens)} tokens")
        length = len(chain.tokens) - count
        keep = self._pages_for(length)
        if length % self.page_size and chain.pages[keep - 1] == RELEASED:
            raise RequestError(
                "invalid", f"cannot truncate into page {keep - 1}: its KV was released"
            )
        self._release_chain([page for page in chain.pages[keep:] if page != RELEASED])
        if count:
            chain.resume = (length, chain.positions[length])
        del chain.pages[keep:]
        del chain.tokens[length:]
        del chain.positions[length:]
        del chain.hashes[length // self.page_size :]
        chain.cut_runs(length)
        chain.written = min(chain.written, length)
        chain.masked = {p for p in chain.masked if p < keep}

    def _describe(self, event: ev.DescribeContext) -> ev.ContextInfo:
        chain = self._owned(event.context, event.requester)
        return ev.ContextInfo(
            corr=event.corr,
            context=event.context,
            tokens=tuple(chain.tokens),
            positions=tuple(chain.positions),
            next_position=chain.next_position(),
            pages=len(chain.held()),
            masked_pages=tuple(sorted(chain.masked)),
            released_pages=tuple(chain.released()),
            reserved_pages=len(chain.reserved),
        )


def _missing(event: ev.OpenContext | ev.DeleteSnapshot, message: str) -> ev.SnapshotMissing:
    """The directory's part of an open or delete of a snapshot this core lacks."""
    return ev.SnapshotMissing(
        corr=event.corr,
        requester=event.requester,
        name=event.name,
        user=event.user,
        take=isinstance(event, ev.OpenContext) and event.take,
        delete=isinstance(event, ev.DeleteSnapshot),
        message=message,
    )
