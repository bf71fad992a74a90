"""`HostError`: a failure the engine reported, and `call`, which turns the bindings' raised
`Err(types.Error)` into one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from componentize_py_types import Err

T = TypeVar("T")


class HostError(Exception):
    """The engine refused or failed a call. `kind` is a stable word to match on (`out-of-pages`,
    `no-such-snapshot`, `snapshot-exists`, `invalid`, ...); `message` is for people."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def call(fn: Callable[..., T], *args: Any) -> T:
    """Calls a host function, raising HostError instead of the bindings' Err."""
    try:
        return fn(*args)
    except Err as err:
        value = err.value
        raise HostError(
            getattr(value, "kind", "failed"), getattr(value, "message", str(value))
        ) from None
