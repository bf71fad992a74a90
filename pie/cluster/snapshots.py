"""The cluster's directory of named snapshots in Redis: which node holds each user's snapshot of
a model, with its size and page hash chain, bounded per user; entries are written and removed
by one Lua script each, so a user's count and the entries never disagree."""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

import coredis
import trio
from attrs import frozen

from pie.cluster.records import NodeRecord, RecordError, node_key
from pie.cluster.store import RedisStore

SNAPSHOT_PREFIX = "pie:snap:"
"""A hash per named snapshot at SNAPSHOT_PREFIX + snapshot_id(model, user, name)."""
SNAPSHOTS_INDEX = "pie:snaps"
"""A set of every entry's id."""
USER_SNAPSHOTS_PREFIX = "pie:snaps:user:"
"""A set per user of its entries' ids: what [cluster] max_user_snapshots bounds."""
NODE_SECRET = "pie:node-secret"
"""A random secret the first node to join writes: a node shows it to fetch another's pages."""
LISTED_SNAPSHOTS = 1000
"""The most entries `pie cluster status` lists."""

# KEYS: entry, index, the user's set. ARGV: id, cap, then field, value pairs.
# A new entry past the user's cap is refused; replacing one of the user's is always allowed.
_PUT = """
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 and
   redis.call('SCARD', KEYS[3]) >= tonumber(ARGV[2]) then
  return 'full'
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
return 'ok'
"""

# KEYS: entry, index, the user's set. ARGV: id, node.
# Removes the entry only while it still names `node`: another node that saved the same name
# since holds the snapshot the entry points at now.
_REMOVE = """
local holder = redis.call('HGET', KEYS[1], 'node')
if holder and holder ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
"""


class DirectoryFull(ValueError):
    """The user holds [cluster] max_user_snapshots entries already."""


async def node_secret(store: RedisStore) -> str:
    """The cluster's node secret, made by whichever node asks first."""
    client = store.client
    with trio.fail_after(store.timeout):
        await client.set(NODE_SECRET, secrets.token_hex(32), condition=coredis.PureToken.NX)
        value = await client.get(NODE_SECRET)
    if value is None:
        raise OSError("the cluster's node secret vanished as it was written")
    return _text(value)


def snapshot_id(model: str, user: str, name: str) -> str:
    """The first 32 hex digits of sha256(model NUL user NUL name)."""
    return hashlib.sha256(f"{model}\0{user}\0{name}".encode()).hexdigest()[:32]


@frozen(kw_only=True)
class SnapshotEntry:
    model: str
    user: str
    name: str
    node: str
    """The node id of the node holding the snapshot's pages."""
    pages: int
    tokens: int
    chain: tuple[str, ...]
    """The hex content hash of each full page, in order (pie/actors/kv/pages.py chain_hash)."""
    saved_at: float

    @property
    def id(self) -> str:
        return snapshot_id(self.model, self.user, self.name)

    def fields(self) -> list[str]:
        """field, value, field, value... as the hash stores them."""
        values = {
            "model": self.model,
            "user": self.user,
            "name": self.name,
            "node": self.node,
            "pages": str(self.pages),
            "tokens": str(self.tokens),
            "chain": json.dumps(list(self.chain)),
            "saved_at": repr(self.saved_at),
        }
        return [item for pair in values.items() for item in pair]

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> SnapshotEntry:
        """Raises RecordError on a hash pie did not write."""
        data = {_text(k): _text(v) for k, v in raw.items()}
        try:
            chain = json.loads(data["chain"])
            if not isinstance(chain, list) or not all(isinstance(h, str) for h in chain):
                raise ValueError("chain is not a list of hex strings")
            return cls(
                model=data["model"],
                user=data["user"],
                name=data["name"],
                node=data["node"],
                pages=int(data["pages"]),
                tokens=int(data["tokens"]),
                chain=tuple(chain),
                saved_at=float(data["saved_at"]),
            )
        except (KeyError, ValueError) as exc:
            raise RecordError(f"not a pie snapshot entry: {exc}") from None


class SnapshotDirectory:
    """The directory through `store`; every method may raise STORE_ERRORS."""

    def __init__(self, store: RedisStore, *, max_user_entries: int) -> None:
        self.store = store
        self.max_user_entries = max_user_entries

    async def put(self, entry: SnapshotEntry) -> None:
        """Writes (or replaces) `entry`; DirectoryFull past the user's cap."""
        keys = self._keys(entry.id, entry.user)
        args: list[Any] = [entry.id, self.max_user_entries, *entry.fields()]
        with trio.fail_after(self.store.timeout):
            outcome = await self.store.client.eval(_PUT, keys, args)
        if _text(outcome) == "full":
            raise DirectoryFull(
                f"you hold {self.max_user_entries} named snapshots in the cluster, its "
                f"[cluster] max_user_snapshots: delete one to save another"
            )

    async def remove(self, model: str, user: str, name: str, node: str) -> bool:
        """Removes the entry of (model, user, name) if it names `node`; whether it did."""
        entry_id = snapshot_id(model, user, name)
        with trio.fail_after(self.store.timeout):
            removed = await self.store.client.eval(
                _REMOVE, self._keys(entry_id, user), [entry_id, node]
            )
        return bool(removed)

    async def lookup(self, model: str, user: str, name: str) -> SnapshotEntry | None:
        """The entry of (model, user, name), or None (also for one pie did not write)."""
        with trio.fail_after(self.store.timeout):
            raw = await self.store.client.hgetall(SNAPSHOT_PREFIX + snapshot_id(model, user, name))
        if not raw:
            return None
        try:
            return SnapshotEntry.from_hash(raw)
        except RecordError:
            return None

    async def user_entries(self, user: str) -> list[SnapshotEntry]:
        """Every entry of `user` (at most its cap)."""
        with trio.fail_after(self.store.timeout):
            ids = await self.store.client.smembers(USER_SNAPSHOTS_PREFIX + user)
        return [e for e in await self._read([_text(i) for i in ids]) if e.user == user]

    async def held_by(self, node: str, model: str) -> list[SnapshotEntry]:
        """Every entry of `model` naming `node`: a scan of the whole directory (for a node
        catching up after Redis was away, not for every command)."""
        ids: list[str] = []
        with trio.fail_after(self.store.timeout * 10):
            async for member in self.store.client.sscan_iter(SNAPSHOTS_INDEX, count=500):
                ids.append(_text(member))
        return [e for e in await self._read(ids) if e.node == node and e.model == model]

    async def holder(self, node: str) -> NodeRecord | None:
        """The live node called `node`, or None when its record has expired."""
        values = await self.store.get_many([node_key(node)])
        if values[0] is None:
            return None
        try:
            return NodeRecord.from_json(values[0])
        except RecordError:
            return None

    async def listed(self, limit: int = LISTED_SNAPSHOTS) -> tuple[list[SnapshotEntry], bool]:
        """Up to `limit` entries, sorted by user, model and name, and whether more were left."""
        ids = await self.store.members(SNAPSHOTS_INDEX, limit + 1)
        entries = await self._read(ids[:limit])
        entries.sort(key=lambda e: (e.user, e.model, e.name))
        return entries, len(ids) > limit

    async def _read(self, ids: list[str]) -> list[SnapshotEntry]:
        entries = []
        for entry_id in ids:
            with trio.fail_after(self.store.timeout):
                raw = await self.store.client.hgetall(SNAPSHOT_PREFIX + entry_id)
            try:
                entries.append(SnapshotEntry.from_hash(raw))
            except RecordError:
                continue
        return entries

    @staticmethod
    def _keys(entry_id: str, user: str) -> list[str]:
        return [SNAPSHOT_PREFIX + entry_id, SNAPSHOTS_INDEX, USER_SNAPSHOTS_PREFIX + user]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
