"""The program registry: inferlet components by content hash, name and version."""

from __future__ import annotations

import hashlib
import re

from attrs import frozen

WASM_MAGIC = b"\0asm"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ProgramError(ValueError):
    """A program that cannot be added, or a reference that names no program."""


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


class ProgramRegistry:
    """Programs added by bytes; looked up by hash, `name` (latest added) or `name@version`."""

    def __init__(self) -> None:
        self._by_hash: dict[str, Program] = {}
        self._by_name: dict[str, dict[str, str]] = {}

    def add(
        self,
        wasm: bytes,
        name: str | None = None,
        version: str | None = None,
        *,
        digest: str | None = None,
    ) -> ProgramInfo:
        """Adds a program; `digest`, when the caller has checked it, saves hashing again."""
        if not wasm.startswith(WASM_MAGIC):
            raise ProgramError("not a WebAssembly binary (it does not start with \\0asm)")
        digest = digest or hashlib.sha256(wasm).hexdigest()
        name = name or f"program-{digest[:12]}"
        version = version or "0.1.0"
        for label, value in (("name", name), ("version", version)):
            if not _NAME.match(value):
                raise ProgramError(f"bad program {label} {value!r}: use letters, digits, . _ -")
        info = ProgramInfo(hash=digest, name=name, version=version, size=len(wasm))
        self._by_hash.setdefault(digest, Program(info=info, wasm=wasm))
        versions = self._by_name.setdefault(name, {})
        versions.pop(version, None)
        versions[version] = digest
        return info

    def resolve(self, reference: str) -> Program:
        """The program a hash, `name` or `name@version` refers to."""
        if reference in self._by_hash:
            return self._by_hash[reference]
        name, _, version = reference.partition("@")
        versions = self._by_name.get(name)
        if versions:
            digest = versions.get(version) if version else list(versions.values())[-1]
            if digest is not None:
                return self._by_hash[digest]
        raise ProgramError(f"no program {reference!r}")

    def list(self) -> list[ProgramInfo]:
        return [p.info for p in self._by_hash.values()]

    def __len__(self) -> int:
        return len(self._by_hash)
