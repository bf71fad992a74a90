"""A clustered node's programs: installs bound in Redis before they count, and launches of a
program this node lacks fetched from Redis (checked against its hash), compiled and cached.
While Redis is away the node serves what it holds, each name only to the user that owns it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from pie.actors.inferlet.programs import ProgramError, ProgramInfo
from pie.cluster.programs import (
    SharedNameTaken,
    SharedProgramError,
    SharedPrograms,
    SharedQuotaExceeded,
    SharedTooLarge,
)
from pie.cluster.store import STORE_ERRORS, reason, redacted
from pie.sandbox import InvalidProgram
from pie.server.hub import Refused
from pie.server.installed import InstalledPrograms

if TYPE_CHECKING:
    from pie.engine import Engine

log = logging.getLogger(__name__)

HASH_LENGTH = 64


class NodePrograms:
    """The node's registry kept in step with the cluster's programs."""

    def __init__(
        self,
        shared: SharedPrograms,
        engine: Engine,
        installed: InstalledPrograms,
        compiles: trio.CapacityLimiter,
    ) -> None:
        self.shared = shared
        self.engine = engine
        self.registry = engine.programs
        self.installed = installed
        self.compiles = compiles
        """The server's limit on compiles at once, shared with its installs."""
        self.redis_away = False
        """True since a Redis command failed, until one succeeds (logged once each way)."""

    async def bind(self, user: str, info: ProgramInfo, wasm: bytes) -> None:
        """Binds `user`'s `info.name@info.version` cluster-wide; Refused when the cluster says
        no or cannot be reached (then nothing is installed anywhere)."""
        try:
            await self.shared.bind(user, info.name, info.version, wasm, info.hash)
        except SharedNameTaken as err:
            raise Refused("name-taken", str(err)) from None
        except SharedTooLarge as err:
            raise Refused("too-large", str(err)) from None
        except SharedQuotaExceeded as err:
            raise Refused("quota", str(err)) from None
        except STORE_ERRORS as exc:
            self._lost(exc)
            raise Refused("cluster-unavailable", self._unavailable(exc, "installs")) from None
        self._back()

    async def resolve(self, reference: str, user: str) -> ProgramInfo:
        """The program `reference` names for `user`, fetched from the cluster when this node
        lacks it; with Redis away, what the node holds (names as owned in its cache)."""
        local = reference
        try:
            local = await self._fetch_for(reference, user)
        except STORE_ERRORS as exc:
            self._lost(exc)
        except SharedProgramError as err:
            raise Refused("no-such-program", str(err)) from None
        else:
            self._back()
        try:
            return self.registry.resolve(local, user).info
        except ProgramError as err:
            raise Refused("no-such-program", str(err)) from None

    async def _fetch_for(self, reference: str, user: str) -> str:
        """Fetches what `reference` names in the cluster when this node lacks it; returns the
        reference to look up here (`name@version` as the cluster binds it, whose latest version
        may differ from the one this node learnt last)."""
        if _is_hash(reference):
            if not self.registry.holds(reference):
                wasm = await self.shared.fetch(reference)
                if wasm is not None:
                    await self.compile(wasm, reference)
                    self.registry.hold(wasm, reference)
            return reference
        binding = await self.shared.binding(user, reference)
        if binding is None:
            await self._publish_own(reference, user)
            return reference
        label = f"{binding.name}@{binding.version}"
        if self.registry.bound(binding.name, binding.version, owner=user) == binding.hash:
            return label
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
        return label

    async def _publish_own(self, reference: str, user: str) -> None:
        """Binds in Redis again a name this node holds as `user`'s own that Redis lacks (a
        Redis restarted without its data), so the user's other nodes find it again."""
        try:
            program = self.registry.resolve(reference, user)
        except ProgramError:
            return
        info = program.info
        if self.registry.bound(info.name, info.version, owner=user) != info.hash:
            return  # the operator's shared name, or none of the user's
        try:
            await self.shared.bind(user, info.name, info.version, program.wasm, info.hash)
        except SharedProgramError as err:
            log.warning(
                "pie: could not share %s@%s of %r again: %s", info.name, info.version, user, err
            )
        else:
            log.info(
                "pie: shared %s@%s of %r again (Redis had lost it)", info.name, info.version, user
            )

    async def compile(self, wasm: bytes, digest: str) -> None:
        """Compiles a program fetched from the cluster into this node's component cache."""
        async with self.compiles:
            try:
                await trio.to_thread.run_sync(self.engine.wasm.cache.load, wasm, digest)
            except InvalidProgram as err:
                raise Refused("invalid-program", str(err)) from None

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
            where = redacted(self.shared.store.url)
            log.warning("pie: Redis at %s answers about programs again", where)
        self.redis_away = False

    def _unavailable(self, exc: BaseException, what: str) -> str:
        where = redacted(self.shared.store.url)
        return f"the cluster's Redis at {where} does not answer ({reason(exc)}): {what} wait for it"


def _is_hash(reference: str) -> bool:
    return len(reference) == HASH_LENGTH and all(c in "0123456789abcdef" for c in reference)
