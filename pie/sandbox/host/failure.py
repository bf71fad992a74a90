"""The failure a host call reports to its guest as `error { kind, message }`."""

from __future__ import annotations


class HostFailure(Exception):
    """A host call that fails; becomes `error { kind, message }` for the guest."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind.replace("_", "-")
        self.message = message
