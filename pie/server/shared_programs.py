"""A clustered node's programs: installs bound in Redis before they count, and launches of a
program this node lacks fetched from Redis (checked against its hash), compiled and cached.
While Redis is away the node serves what it holds, each name only to the user that owns it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from pie.actors.inferlet.programs import ProgramError, ProgramInfo, ProgramRegistry
from pie.cluster.programs import (
    SharedNameTaken,
    SharedProgramError,
    SharedPrograms,
    SharedQuotaExceeded,
)
from pie.cluster.store import STORE_ERRORS, reason, redacted
from pie.server.hub import Refused
from pie.server.installed import InstalledPrograms

log = logging.getLogger(__name__)

HASH_LENGTH = 64

Compile = Callable[[bytes, str], Awaitable[None]]
"""Compiles a component (bytes, sha256) into the node's cache; raises Refused when invalid."""


class NodePrograms:
    """The node's registry kept in step with the cluster's programs."""

    def __init__(
        self,
        shared: SharedPrograms,
        registry: ProgramRegistry,
        installed: InstalledPrograms,
        compile_: Compile,
    ) -> None:
        self.shared = shared
        self.registry = registry
        self.installed = installed
        self.compile = compile_
        self.redis_away = False
        """True since a Redis command failed, until one succeeds (logged once each way)."""

    async def bind(self, user: str, info: ProgramInfo, wasm: bytes) -> None:
        """Binds `user`'s `info.name@info.version` cluster-wide; Refused when the cluster says
        no or cannot be reached (then nothing is installed anywhere)."""
        try:
            await self.shared.bind(user, info.name, info.version, wasm, info.hash)
        except SharedNameTaken as err:
            raise Refused("name-taken", str(err)) from None
        except SharedQuotaExceeded as err:
            raise Refused("too-large", str(err)) from None
        except STORE_ERRORS as exc:
            self._lost(exc)
            raise Refused("cluster-unavailable", self._unavailable(exc, "installs")) from None
        self._back()

    async def resolve(self, reference: str, user: str) -> ProgramInfo:
        """The program `reference` names for `user`, fetched from the cluster when this node
        lacks it; with Redis away, what the node holds (names as owned in its cache)."""
        try:
            await self._fetch_for(reference, user)
        except STORE_ERRORS as exc:
            self._lost(exc)
        except SharedProgramError as err:
            raise Refused("no-such-program", str(err)) from None
        else:
            self._back()
        try:
            return self.registry.resolve(reference, user).info
        except ProgramError as err:
            raise Refused("no-such-program", str(err)) from None

    async def _fetch_for(self, reference: str, user: str) -> None:
        if _is_hash(reference):
            if not self.registry.holds(reference):
                wasm = await self.shared.fetch(reference)
                if wasm is not None:
                    await self.compile(wasm, reference)
                    self.registry.hold(wasm, reference)
            return
        binding = await self.shared.binding(user, reference)
        if binding is None:
            return
        if self.registry.bound(binding.name, binding.version, owner=user) == binding.hash:
            return
        label = f"{binding.name}@{binding.version}"
        wasm = await self.shared.fetch(binding.hash)
        if wasm is None:
            raise SharedProgramError(f"the cluster lost the bytes of {label} ({binding.hash[:12]})")
        await self.compile(wasm, binding.hash)
        try:
            info = self.registry.add(
                wasm, binding.name, binding.version, owner=user, digest=binding.hash
            )
        except ProgramError as err:
            raise SharedProgramError(str(err)) from None
        await trio.to_thread.run_sync(self.installed.record, user, info, wasm)

    def _lost(self, exc: BaseException) -> None:
        if not self.redis_away:
            log.warning(
                "pie: Redis at %s did not answer about programs (%s): serving the programs "
                "this node holds; installs wait for Redis",
                redacted(self.shared.store.url),
                reason(exc),
            )
        self.redis_away = True

    def _back(self) -> None:
        if self.redis_away:
            log.warning("pie: Redis at %s answers about programs again", self.shared.store.url)
        self.redis_away = False

    def _unavailable(self, exc: BaseException, what: str) -> str:
        where = redacted(self.shared.store.url)
        return f"the cluster's Redis at {where} does not answer ({reason(exc)}): {what} wait for it"


def _is_hash(reference: str) -> bool:
    return len(reference) == HASH_LENGTH and all(c in "0123456789abcdef" for c in reference)
