"""The kv actor's shell: the pure core's replies, held back until the named snapshots they
change are kept on disk (when a store is given) and in the cluster's directory (on a clustered
node), and the rebuilding of kept snapshots at start, their media added back first."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from pie.actors.kv.context import Chain
from pie.actors.kv.core import KvCore
from pie.actors.kv.durable import SnapshotRecord, SnapshotStore
from pie.actors.kv.media_blobs import MediaHolder, MediaSource
from pie.actors.requester import Requester, RequestRefused
from pie.actors.runtime import CoreActor, Router
from pie.events import kv as ev
from pie.events.forward import split_media

log = logging.getLogger(__name__)

Outputs = list[tuple[str, Any]]


class DirectoryRefused(Exception):
    """The cluster's directory refused a saved snapshot's entry (`kind`, e.g. quota)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class SharedSnapshots(Protocol):
    """A clustered node's directory of named snapshots, as the kv actor tells it of changes
    (commands on snapshots the core lacks reach it as `SnapshotMissing` events instead)."""

    async def saved(self, user: str, name: str, snapshot: Chain) -> None:
        """Enters the snapshot just saved; raises DirectoryRefused to undo the save."""

    async def removed(self, user: str, name: str) -> None: ...

    async def dropped(self, user: str) -> None: ...


class KvActor(CoreActor):
    """Without a store, the core's replies go out as they are: snapshots live until the process
    ends. With one, a save is answered after its record (and the encoded media it names, from
    `media`) is fsync'd, and a delete, a take or a drop after its records are gone."""

    core: KvCore

    def __init__(
        self,
        core: KvCore,
        router: Router,
        store: SnapshotStore | None = None,
        *,
        address: str = "kv",
        media: MediaHolder | None = None,
    ) -> None:
        super().__init__(core, address, router)
        self.store = store
        self.media = media
        self.shared: SharedSnapshots | None = None
        """Set on a clustered node: the cluster's directory of named snapshots."""

    async def handle(self, event: Any) -> None:
        outputs = self.core.handle(event)
        if self.store is not None and _succeeded(outputs):
            outputs = await self._keep(self.store, event, outputs)
        if self.shared is not None:
            outputs = await self._share(self.shared, event, outputs)
        self.emit([_answered_here(o) if o[0] not in self.router else o for o in outputs])

    async def _share(self, shared: SharedSnapshots, event: Any, outputs: Outputs) -> Outputs:
        """Tells the directory what the command changed (after the disk, so an entry never
        names a snapshot a restart would lose)."""
        if not _succeeded(outputs) or outputs[0][0] == self.core.directory:
            return outputs
        match event:
            case ev.SaveContext(user=user, name=name):
                try:
                    await shared.saved(user, name, self.core.snapshots[(user, name)])
                except DirectoryRefused as refused:
                    return await self._unshare(event, refused)
            case (
                ev.DeleteSnapshot(user=user, name=name)
                | ev.OpenContext(take=True, user=user, name=name)
            ):
                await shared.removed(user, name)
            case ev.DropSnapshots(user=user):
                await shared.dropped(user)
        return outputs

    async def _unshare(self, event: ev.SaveContext, refused: DirectoryRefused) -> Outputs:
        """A save the directory refused is undone, on disk too."""
        forget = ev.DeleteSnapshot(
            corr=event.corr, requester=event.requester, name=event.name, user=event.user
        )
        self.core.handle(forget)
        if self.store is not None:
            await _logged(self.store.remove, event.user, event.name)
        failed = ev.RequestFailed(corr=event.corr, kind=refused.kind, message=str(refused))
        return [(event.requester, failed)]

    async def _keep(self, store: SnapshotStore, event: Any, outputs: Outputs) -> Outputs:
        match event:
            case ev.SaveContext(user=user, name=name):
                snapshot = self.core.snapshots[(user, name)]
                sources = self._sources({run.media for run in snapshot.media_runs})
                if sources is None:
                    log.warning(
                        "named snapshots: %r of %r holds media no program holds now and is "
                        "kept in memory only",
                        name,
                        user,
                    )
                    return outputs
                record = SnapshotRecord.of(user, name, snapshot)
                try:
                    if sources:
                        await trio.to_thread.run_sync(store.keep_media, sources)
                    await trio.to_thread.run_sync(store.write, record)
                except OSError as exc:
                    return self._unsave(event, exc)
            case (
                ev.DeleteSnapshot(user=user, name=name)
                | ev.OpenContext(take=True, user=user, name=name)
            ):
                await _logged(store.remove, user, name)
            case ev.DropSnapshots(user=user):
                await _logged(store.drop, user)
        return outputs

    def _sources(self, keys: set[str]) -> dict[str, MediaSource] | None:
        """What each medium was added from, or None when one is no longer held."""
        if not keys:
            return {}
        found = {} if self.media is None else {key: self.media.source(key) for key in keys}
        if len(found) < len(keys) or None in found.values():
            return None
        return {key: source for key, source in found.items() if source is not None}

    def _unsave(self, event: ev.SaveContext, exc: OSError) -> Outputs:
        """A snapshot that could not be kept is not kept in memory either: a save is answered
        as done only when the snapshot would survive a restart."""
        log.error("named snapshots: could not keep %r of %r: %s", event.name, event.user, exc)
        forget = ev.DeleteSnapshot(
            corr=event.corr, requester=event.requester, name=event.name, user=event.user
        )
        self.core.handle(forget)
        message = f"the snapshot could not be kept on disk ({exc.strerror or exc})"
        failed = ev.RequestFailed(corr=event.corr, kind="internal", message=message)
        return [(event.requester, failed)]

    async def recover(self, requester: Requester) -> int:
        """Rebuilds every kept snapshot by recomputing its tokens into fresh pages; returns how
        many. One that cannot be rebuilt (over its user's quotas, tokens this model does not
        have) is logged and its record kept, for a later start with more room."""
        if self.store is None:
            return 0
        records = await trio.to_thread.run_sync(self.store.read_all)
        rebuilt = 0
        for record in records:
            try:
                keys = await self._hold_media(self.store, record)
            except (OSError, ValueError) as err:
                log.warning(
                    "named snapshots: %r of %r not rebuilt (its media: %s)",
                    record.name,
                    record.user,
                    err,
                )
                continue
            try:
                await rebuild(requester, record)
            except RequestRefused as err:
                log.warning(
                    "named snapshots: %r of %r not rebuilt (%s)", record.name, record.user, err
                )
            else:
                rebuilt += 1
            finally:
                self._release(keys)
        return rebuilt

    async def _hold_media(self, store: SnapshotStore, record: SnapshotRecord) -> list[str]:
        """Adds the media `record` names back to the model's media store, each identical to
        the one it was saved from (the same key); the keys held."""
        keys = sorted({run.media for run in record.media})
        if keys and self.media is None:
            raise ValueError("this model takes no media")
        held: list[str] = []
        try:
            for key in keys:
                kind, max_frames, data = await trio.to_thread.run_sync(store.media.read, key)
                item = await trio.to_thread.run_sync(self._add, kind, data, max_frames)
                held.append(item.key)
                if item.key != key:
                    raise ValueError(f"media {key} does not rebuild the same item")
        except BaseException:
            self._release(held)
            raise
        return held

    def _add(self, kind: str, data: bytes, max_frames: int | None) -> Any:
        assert self.media is not None
        return self.media.add(kind, data, max_frames)

    def _release(self, keys: list[str]) -> None:
        for key in keys:
            assert self.media is not None
            self.media.release(key)


async def rebuild(requester: Requester, record: SnapshotRecord) -> None:
    """Saves `record`'s snapshot again: its tokens at their positions, one pass per run of
    tokens through the adapter they ran through, under the attention masks they ran under and
    with the media their soft tokens came from (the scheduler chunks a long one), then its
    masked and released pages, on a context destroyed afterwards. The tokens go in from an
    empty context in order, so each lands at the kv slot it had and its recorded mask, over the
    slots up to its own, applies as it was."""
    context = await requester.create_context(user=record.user)
    try:
        for start, end, adapter, masks in record.segments():
            await requester.call(
                requester.kv,
                ev.SubmitForward,
                context=context,
                tokens=record.tokens[start:end],
                positions=record.positions[start:end],
                attention_masks=masks,
                adapter=adapter,
                media=split_media(record.media, start, end),
            )
        if record.masked:
            await requester.mask_pages(context, record.masked)
        if record.released:
            await requester.release_pages(context, record.released)
        await requester.save(context, record.name, user=record.user)
    finally:
        await requester.destroy(context)


def _succeeded(outputs: Outputs) -> bool:
    return bool(outputs) and not isinstance(outputs[0][1], ev.RequestFailed)


async def _logged(remove: Any, *args: str) -> None:
    """A record that cannot be removed is logged: the snapshot is gone from memory already (its
    pages are free), so it comes back only after a restart."""
    try:
        await trio.to_thread.run_sync(remove, *args)
    except OSError as exc:
        log.error("named snapshots: could not remove the record of %s: %s", args, exc)


def _answered_here(output: tuple[str, Any]) -> tuple[str, Any]:
    """A hand-off to a directory that is not there (an engine opened with a cluster's config
    but not joined to it) answered as a core without one answers it."""
    missing = output[1]
    if not isinstance(missing, ev.SnapshotMissing):
        return output
    failed = ev.RequestFailed(corr=missing.corr, kind="no_such_snapshot", message=missing.message)
    return (missing.requester, failed)
