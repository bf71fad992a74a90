"""The program registry: inferlet components by content hash, and the names bound to them in
each user's own namespace and in the operator's shared one."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

from attrs import frozen

WASM_MAGIC = b"\0asm"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")
DEFAULT_VERSION = "0.1.0"


class ProgramError(ValueError):
    """A program that cannot be added, or a reference that names no program."""


class NameTaken(ProgramError):
    """A `name@version` already bound to other bytes: a binding is never changed."""


@frozen(kw_only=True)
class ProgramInfo:
    hash: str
    """sha256 of the component's bytes, hex."""
    name: str
    version: str
    size: int


@frozen(kw_only=True)
class Program:
    info: ProgramInfo
    wasm: bytes


Owner = str | None
"""A user's namespace, or None for the shared one the operator fills at start."""


class ProgramRegistry:
    """Programs added by bytes. A hash finds any program; `name` (latest added) and
    `name@version` are looked up in the user's own namespace, then in the shared one, so no
    user can put code under a name another user launches."""

    def __init__(self) -> None:
        self._wasm: dict[str, bytes] = {}
        self._names: dict[Owner, dict[str, dict[str, str]]] = {}
        self._labels: dict[tuple[Owner, str], tuple[str, str]] = {}
        self.on_add: Callable[[ProgramInfo, Owner], None] | None = None
        """Told of every binding `add` makes, on the thread that made it (the event log)."""

    def add(
        self,
        wasm: bytes,
        name: str | None = None,
        version: str | None = None,
        *,
        owner: Owner = None,
        digest: str | None = None,
    ) -> ProgramInfo:
        """Binds `name@version` in `owner`'s namespace (None: the shared one) to `wasm`;
        `digest`, when the caller has checked it, saves hashing again. Raises NameTaken when
        the name is bound to other bytes."""
        if not wasm.startswith(WASM_MAGIC):
            raise ProgramError("not a WebAssembly binary (it does not start with \\0asm)")
        digest = digest or hashlib.sha256(wasm).hexdigest()
        name = name or f"program-{digest[:12]}"
        version = version or DEFAULT_VERSION
        for label, value in (("name", name), ("version", version)):
            if not _NAME.match(value):
                raise ProgramError(f"bad program {label} {value!r}: use letters, digits, . _ -")
        self.check_free(name, version, digest, owner=owner)
        versions = self._names.setdefault(owner, {}).setdefault(name, {})
        versions.pop(version, None)
        versions[version] = digest
        self._wasm.setdefault(digest, wasm)
        self._labels.setdefault((owner, digest), (name, version))
        info = ProgramInfo(hash=digest, name=name, version=version, size=len(wasm))
        if self.on_add is not None:
            self.on_add(info, owner)
        return info

    def hold(self, wasm: bytes, digest: str) -> None:
        """Keeps `wasm` (checked by the caller to hash to `digest`) to be found by its hash,
        binding no name: a program fetched from another node's install."""
        if not wasm.startswith(WASM_MAGIC):
            raise ProgramError("not a WebAssembly binary (it does not start with \\0asm)")
        self._wasm.setdefault(digest, wasm)

    def holds(self, digest: str) -> bool:
        return digest in self._wasm

    def bound(self, name: str, version: str, *, owner: Owner) -> str | None:
        """The hash `owner`'s own `name@version` is bound to, or None (no shared fallback)."""
        return self._names.get(owner, {}).get(name, {}).get(version)

    def bindings(self) -> list[tuple[ProgramInfo, Owner]]:
        """Every name@version bound so far, with its owner (grouped by owner)."""
        return [
            (self._info(digest, name, version), owner)
            for owner, names in self._names.items()
            for name, versions in names.items()
            for version, digest in versions.items()
        ]

    def check_free(self, name: str, version: str, digest: str, *, owner: Owner = None) -> None:
        """Raises NameTaken when `owner` has `name@version` bound to bytes other than `digest`."""
        bound = self._names.get(owner, {}).get(name, {}).get(version, digest)
        if bound != digest:
            raise NameTaken(
                f"{name}@{version} is already installed with other bytes ({bound[:12]}); "
                "install the new program under a new version"
            )

    def resolve(self, reference: str, user: Owner = None) -> Program:
        """The program a hash, `name` or `name@version` refers to for `user`."""
        if _HASH.match(reference) and reference in self._wasm:
            return self._program(reference, user)
        name, _, version = reference.partition("@")
        for owner in _namespaces(user):
            versions = self._names.get(owner, {}).get(name)
            if versions:
                digest = versions.get(version) if version else list(versions.values())[-1]
                if digest is not None:
                    return self._program(digest, owner)
        raise ProgramError(f"no program {reference!r}")

    def list(self, user: Owner = None) -> list[ProgramInfo]:
        """The named programs `user` sees (its own, then the shared ones)."""
        return [
            self._info(digest, name, version)
            for owner in _namespaces(user)
            for name, versions in self._names.get(owner, {}).items()
            for version, digest in versions.items()
        ]

    def _program(self, digest: str, user: Owner) -> Program:
        """A program labelled as `user` knows it; another user's names are never shown."""
        for owner in _namespaces(user):
            label = self._labels.get((owner, digest))
            if label is not None:
                break
        else:
            label = (f"program-{digest[:12]}", DEFAULT_VERSION)
        return Program(info=self._info(digest, *label), wasm=self._wasm[digest])

    def _info(self, digest: str, name: str, version: str) -> ProgramInfo:
        return ProgramInfo(hash=digest, name=name, version=version, size=len(self._wasm[digest]))

    def __len__(self) -> int:
        return len(self._wasm)


def _namespaces(user: Owner) -> tuple[Owner, ...]:
    return (None,) if user is None else (user, None)
