"""A clustered node's named snapshots of one model: entered in the cluster's directory when saved,
removed when deleted, taken or dropped; and an open of one this node lacks, found through the
directory: refused naming its holder ("place"), reported lost when its holder is gone, or copied
from the holder ("copy"). An entry only ever serves the user it is keyed by."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from pie.actors.kv.actor import DirectoryRefused
from pie.actors.kv.context import Chain
from pie.actors.runtime import MailboxOverrun, UnexpectedEvent, UnknownAddress
from pie.cluster.records import NodeRecord
from pie.cluster.snapshots import DirectoryFull, SnapshotDirectory, SnapshotEntry
from pie.cluster.store import STORE_ERRORS, reason, redacted
from pie.config import ClusterConfig
from pie.engine.stack import directory_address
from pie.events import kv as ev
from pie.server.snapshot_copy import CopyFailed, check_chain, fetch, install

if TYPE_CHECKING:
    from pie.engine import Engine
    from pie.engine.stack import ModelStack

log = logging.getLogger(__name__)

Reply = ev.Done | ev.RequestFailed


class NodeSnapshots:
    """The directory as the kv actor of `stack` sees it (pie.actors.kv.actor.SharedSnapshots),
    and the address its kv core hands snapshots it lacks to; those are looked up in `nursery`,
    so the kv actor never waits on them."""

    def __init__(
        self,
        directory: SnapshotDirectory,
        config: ClusterConfig,
        engine: Engine,
        stack: ModelStack,
        *,
        secret: str,
        nursery: trio.Nursery,
        copies: trio.CapacityLimiter,
    ) -> None:
        """`copies` bounds the copies the node makes at once (all its models together)."""
        self.directory = directory
        self.config = config
        self.node_id = config.node_id
        self.engine = engine
        self.stack = stack
        self.secret = secret
        self.nursery = nursery
        self.copying = copies
        self.copies = 0
        """Snapshots copied from other nodes."""
        self._catching_up = False
        self._changed = False
        """A snapshot was saved or removed while catching up: catch up once more."""
        self.address = directory_address(stack.kv_address)
        engine.router.register_handler(self.address, ev.SnapshotMissing, self._missing)

    async def publish_all(self) -> None:
        """(Re)writes the entries of every snapshot this model holds now (those rebuilt from
        disk at start): a restarted node names itself again as their holder. Raises
        STORE_ERRORS."""
        for (user, name), snapshot in list(self.stack.kv.core.snapshots.items()):
            try:
                await self._enter(user, name, snapshot)
            except DirectoryFull as full:
                log.warning("named snapshots: %r of %r left out: %s", name, user, full)

    def redis_back(self) -> None:
        """Redis answers again after failing: the directory may have lost entries (a restart
        without its data) or kept ones this node removed meanwhile; catch up in the background."""
        if not self._catching_up:
            self._catching_up = True
            self.nursery.start_soon(self._catch_up)

    async def _catch_up(self) -> None:
        delay = self.config.renew_seconds
        try:
            while True:
                self._changed = False
                try:
                    await self.reconcile()
                except STORE_ERRORS:
                    await trio.sleep(delay)
                    delay = min(delay * 2, 10.0)
                else:
                    if not self._changed:
                        log.warning("named snapshots: the directory has this node's entries again")
                        return
        finally:
            self._catching_up = False

    async def reconcile(self) -> None:
        """Removes the entries naming this node for snapshots it no longer holds, and enters
        every snapshot it holds; raises STORE_ERRORS."""
        held = self.stack.kv.core.snapshots
        for entry in await self.directory.held_by(self.node_id, self.stack.name):
            if (entry.user, entry.name) not in held:
                await self.directory.remove(entry.model, entry.user, entry.name, self.node_id)
        await self.publish_all()

    async def saved(self, user: str, name: str, snapshot: Chain) -> None:
        if self._catching_up:
            self._changed = True  # Redis is away: the catch-up enters it; no save waits on it
            return
        try:
            await self._enter(user, name, snapshot)
        except DirectoryFull as full:
            raise DirectoryRefused("quota", str(full)) from None
        except STORE_ERRORS as exc:
            self._unwritten(f"the entry of {name!r} of {user!r}", exc)

    async def _enter(self, user: str, name: str, snapshot: Chain) -> None:
        entry = SnapshotEntry(
            model=self.stack.name,
            user=user,
            name=name,
            node=self.node_id,
            pages=len(snapshot.held()),
            tokens=len(snapshot.tokens),
            chain=tuple(h.hex() for h in snapshot.hashes),
            saved_at=time.time(),
        )
        await self.directory.put(entry)

    async def removed(self, user: str, name: str) -> None:
        if self._catching_up:
            self._changed = True  # the catch-up removes it
            return
        try:
            await self.directory.remove(self.stack.name, user, name, self.node_id)
        except STORE_ERRORS as exc:
            self._unwritten(f"the removal of {name!r} of {user!r}", exc)

    async def dropped(self, user: str) -> None:
        if self._catching_up:
            self._changed = True
            return
        try:
            for entry in await self.directory.user_entries(user):
                if entry.model == self.stack.name and entry.node == self.node_id:
                    await self.directory.remove(entry.model, user, entry.name, self.node_id)
        except STORE_ERRORS as exc:
            self._unwritten(f"the removal of the snapshots of {user!r}", exc)

    def _missing(self, event: ev.SnapshotMissing) -> None:
        try:
            self.nursery.start_soon(self._resolve, event)
        except RuntimeError:
            pass  # the node is stopping, and its requesters with it

    async def _resolve(self, event: ev.SnapshotMissing) -> None:
        failed = ev.RequestFailed(corr=event.corr, kind="no_such_snapshot", message=event.message)
        try:
            reply = await self._elsewhere(event, failed)
        except STORE_ERRORS as exc:
            where = redacted(self.directory.store.url)
            message = (
                f"{failed.message} on this node, and the cluster's Redis at {where} does not "
                f"answer ({reason(exc)}) to say where it is"
            )
            reply = ev.RequestFailed(corr=event.corr, kind="cluster-unavailable", message=message)
        except CopyFailed as err:
            kind, message = "snapshot-copy-failed", f"copying snapshot {event.name!r}: {err}"
            reply = ev.RequestFailed(corr=event.corr, kind=kind, message=message)
        except Exception:  # one open's failure must not take the node down
            log.exception("named snapshots: looking for %r of %r failed", event.name, event.user)
            message = "the engine failed on this request (the server's log has the details)"
            reply = ev.RequestFailed(corr=event.corr, kind="internal", message=message)
        if reply is not None:
            self._answer(event.requester, reply)

    async def _elsewhere(self, event: ev.SnapshotMissing, failed: ev.RequestFailed) -> Reply | None:
        """The answer to a command on a snapshot this node lacks (None: the open was sent to
        the kv actor again after a copy)."""
        entry = await self.directory.lookup(self.stack.name, event.user, event.name)
        if entry is None or entry.user != event.user or entry.name != event.name:
            return failed  # a stale or foreign entry never grants anything
        if entry.model != self.stack.name or entry.node == self.node_id:
            return failed
        holder = await self.directory.holder(entry.node)
        if holder is None:
            return await self._lost(event, entry)
        if event.delete or event.take:
            return self._elsewhere_failure(event, holder, "delete or take it there")
        if self.config.remote_snapshots == "place":
            return self._elsewhere_failure(event, holder, "launch the program there")
        await self._copy(entry, holder)
        again = ev.OpenContext(
            corr=event.corr, requester=event.requester, name=event.name, user=event.user
        )
        self.engine.router.send_nowait(event.requester, self.stack.kv_address, again)
        return None

    async def _lost(self, event: ev.SnapshotMissing, entry: SnapshotEntry) -> Reply:
        if event.delete:
            # Deleting a lost snapshot clears its entry, which counted against the user's cap.
            await self.directory.remove(entry.model, entry.user, entry.name, entry.node)
            return ev.Done(corr=event.corr)
        message = (
            f"snapshot {entry.name!r} was held by node {entry.node}, which is no longer in the "
            f"cluster (its record expired): the snapshot is lost"
        )
        return ev.RequestFailed(corr=event.corr, kind="snapshot-lost", message=message)

    def _elsewhere_failure(
        self, event: ev.SnapshotMissing, holder: NodeRecord, advice: str
    ) -> Reply:
        message = f"snapshot {event.name!r} is held by {holder.node_id} ({holder.ws_url}): {advice}"
        return ev.RequestFailed(corr=event.corr, kind="snapshot-elsewhere", message=message)

    async def _copy(self, entry: SnapshotEntry, holder: NodeRecord) -> None:
        if not holder.http_url:
            raise CopyFailed(f"{holder.node_id} serves no HTTP front to copy from")
        limit = self.config.max_snapshot_copy_mb << 20
        timeout = max(30.0, self.config.connect_timeout_seconds)
        async with self.copying:
            transfer = await fetch(
                holder.http_url, self.secret, entry, max_bytes=limit, timeout=timeout
            )
            core = self.stack.kv.core
            check_chain(transfer, entry, core.prefix_cache, core.page_size)
            await install(self.engine, self.stack, transfer, entry)
        self.copies += 1
        log.info("named snapshots: copied %r of %r from %s", entry.name, entry.user, entry.node)

    def _answer(self, requester: str, reply: Any) -> None:
        try:
            self.engine.router.send_nowait(self.address, requester, reply)
        except (UnknownAddress, MailboxOverrun, UnexpectedEvent):
            pass  # the requester is gone: nobody is left to tell

    def _unwritten(self, what: str, exc: BaseException) -> None:
        where = redacted(self.directory.store.url)
        log.warning(
            "named snapshots: %s was not written to the directory at %s (%s); the node "
            "catches up when Redis answers again",
            what,
            where,
            reason(exc),
        )
        self.redis_back()
