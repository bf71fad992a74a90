"""Installed programs shared through Redis: each component's bytes once, by sha256, and each
user's names (name@version -> hash), bound by one Lua script so that a name is never rebound
to other bytes and a user's bytes stay under the quota, whichever node installs."""

from __future__ import annotations

import hashlib
from typing import Any

import trio
from attrs import frozen

from pie.cluster.store import RedisStore

PROGRAM_PREFIX = "pie:program:"
"""The component's bytes, at PROGRAM_PREFIX + sha256 (hex)."""
BINDINGS_PREFIX = "pie:bindings:"
"""A hash per user: `name@version` -> sha256."""
LATEST_PREFIX = "pie:latest:"
"""A hash per user: `name` -> the version bound last (what a bare `name` launches)."""
USER_PROGRAMS_PREFIX = "pie:user-programs:"
"""A set per user: the hashes its bindings count against its quota (each once)."""
USER_BYTES_PREFIX = "pie:user-bytes:"
"""An integer per user: the bytes of the hashes in its set."""
LISTED_PROGRAMS = 1000
"""The most bindings `pie cluster status` lists."""

# KEYS: bindings, latest, user programs, user bytes, program.
# ARGV: name, version, sha256, bytes, size, quota.
# The check and the writes run as one step in Redis, so two nodes installing at once cannot
# both bind a name, nor both pass the quota.
_BIND = """
local label = ARGV[1] .. '@' .. ARGV[2]
local bound = redis.call('HGET', KEYS[1], label)
if bound and bound ~= ARGV[3] then return {'taken', bound} end
if redis.call('SISMEMBER', KEYS[3], ARGV[3]) == 0 then
  local total = tonumber(redis.call('GET', KEYS[4]) or '0')
  if total + tonumber(ARGV[5]) > tonumber(ARGV[6]) then return {'full', tostring(total)} end
  redis.call('SADD', KEYS[3], ARGV[3])
  redis.call('INCRBY', KEYS[4], ARGV[5])
end
if redis.call('EXISTS', KEYS[5]) == 0 then redis.call('SET', KEYS[5], ARGV[4]) end
redis.call('HSET', KEYS[1], label, ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {'ok', ARGV[3]}
"""


class SharedProgramError(ValueError):
    """An install the cluster store refuses; the message says why, in one line."""


class SharedNameTaken(SharedProgramError):
    """The user's `name@version` is bound to other bytes in the cluster."""


class SharedTooLarge(SharedProgramError):
    """The program is larger than [cluster] max_program_mb."""


class SharedQuotaExceeded(SharedProgramError):
    """The program would take the user's programs past [cluster] max_user_programs_mb."""


@frozen(kw_only=True)
class Binding:
    """One user's `name@version` and the hash it is bound to."""

    name: str
    version: str
    hash: str


@frozen(kw_only=True)
class InstalledProgram:
    """A user's binding as `pie cluster status` shows it."""

    user: str
    name: str
    version: str
    hash: str
    size: int


async def installed_programs(
    store: RedisStore, limit: int = LISTED_PROGRAMS
) -> tuple[tuple[InstalledProgram, ...], bool]:
    """Up to `limit` bindings of every user (sorted), and whether more were left out."""
    client, found = store.client, []
    with trio.fail_after(store.timeout * 4):
        async for key in client.scan_iter(match=BINDINGS_PREFIX + "*", count=200):
            user = _text(key)[len(BINDINGS_PREFIX) :]
            for label, digest in (await client.hgetall(key)).items():
                name, _, version = _text(label).partition("@")
                found.append((user, name, version, _text(digest)))
            if len(found) > limit:
                break
        found.sort()
        sizes = {d: await client.strlen(PROGRAM_PREFIX + d) for d in {f[3] for f in found[:limit]}}
    listed = tuple(
        InstalledProgram(user=u, name=n, version=v, hash=d, size=sizes[d])
        for u, n, v, d in found[:limit]
    )
    return listed, len(found) > limit


class SharedPrograms:
    """The programs of a cluster, through `store`; every method may raise STORE_ERRORS."""

    def __init__(self, store: RedisStore, *, max_program_bytes: int, max_user_bytes: int) -> None:
        self.store = store
        self.max_program_bytes = max_program_bytes
        self.max_user_bytes = max_user_bytes

    async def bind(self, user: str, name: str, version: str, wasm: bytes, digest: str) -> None:
        """Stores `wasm` (once per hash) and binds `user`'s `name@version` to it; raises
        SharedTooLarge, SharedNameTaken or SharedQuotaExceeded instead of changing anything."""
        if len(wasm) > self.max_program_bytes:
            raise SharedTooLarge(
                f"the program is {_mib(len(wasm))}, more than the cluster takes "
                f"([cluster] max_program_mb = {self.max_program_bytes >> 20})"
            )
        keys = [
            BINDINGS_PREFIX + user,
            LATEST_PREFIX + user,
            USER_PROGRAMS_PREFIX + user,
            USER_BYTES_PREFIX + user,
            PROGRAM_PREFIX + digest,
        ]
        args: list[Any] = [name, version, digest, wasm, len(wasm), self.max_user_bytes]
        with trio.fail_after(self.store.timeout):
            outcome, detail = await self.store.client.eval(_BIND, keys, args)
        _raise_refusal(_text(outcome), _text(detail), name, version, len(wasm), self)

    async def binding(self, user: str, reference: str) -> Binding | None:
        """What `name` (the latest version) or `name@version` is bound to for `user`, or None."""
        name, _, version = reference.partition("@")
        client = self.store.client
        with trio.fail_after(self.store.timeout):
            if not version:
                latest = await client.hget(LATEST_PREFIX + user, name)
                if latest is None:
                    return None
                version = _text(latest)
            digest = await client.hget(BINDINGS_PREFIX + user, f"{name}@{version}")
        if digest is None:
            return None
        return Binding(name=name, version=version, hash=_text(digest))

    async def fetch(self, digest: str) -> bytes | None:
        """The bytes stored under `digest`, checked against it; None when there are none."""
        with trio.fail_after(self.store.timeout):
            wasm = await self.store.client.get(PROGRAM_PREFIX + digest)
        if wasm is None:
            return None
        if hashlib.sha256(wasm).hexdigest() != digest:
            raise SharedProgramError(f"the cluster's bytes for {digest[:12]} do not hash to it")
        return bytes(wasm)


def _raise_refusal(
    outcome: str, detail: str, name: str, version: str, size: int, shared: SharedPrograms
) -> None:
    if outcome == "taken":
        raise SharedNameTaken(
            f"{name}@{version} is already installed in the cluster with other bytes "
            f"({detail[:12]}); install the new program under a new version"
        )
    if outcome == "full":
        raise SharedQuotaExceeded(
            f"the program ({_mib(size)}) would take your programs in the cluster past "
            f"{_mib(shared.max_user_bytes)} (you hold {_mib(int(detail))}; "
            f"[cluster] max_user_programs_mb)"
        )
    assert outcome == "ok", outcome


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
