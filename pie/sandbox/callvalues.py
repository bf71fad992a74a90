"""Host-call values as JSON, losslessly: what host functions take and return (records,
variants, `Ok`/`Err`, bytes, tuples, numbers, lists) and what one raised, for recorded calls.

Numbers, strings, booleans, null and lists are themselves; everything else is an object with
one key that names its kind: `{"bytes": base64}`, `{"tuple": [...]}`, `{"record": {...}}`,
`{"variant": [tag, payload]}`, `{"ok": v}`, `{"err": v}`, `{"raise": {...}}`."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import numpy as np
from attrs import frozen
from wasmtime.component import Record, Variant

from pie.sandbox.runtime import GuestStopped
from pie.sandbox.values import Err, Ok


class Unrecordable(TypeError):
    """A value of a kind host calls never carry (so a recording of it could not be replayed)."""


def encode(value: Any) -> Any:
    """`value` as JSON-ready data."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, np.ndarray):
        return [encode(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return encode(value.item())
    return _encode_tagged(value)


def _encode_tagged(value: Any) -> Any:
    match value:
        case tuple():
            return {"tuple": [encode(v) for v in value]}
        case Record():
            return {"record": {name: encode(v) for name, v in vars(value).items()}}
        case Variant():
            return {"variant": [value.tag, encode(value.payload)]}
        case Ok():
            return {"ok": encode(value.value)}
        case Err():
            return {"err": encode(value.value)}
    raise Unrecordable(f"a host call carried a {type(value).__name__}, which cannot be recorded")


def decode(data: Any) -> Any:
    """The value `encode` made `data` from."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) != 1:
        raise ValueError(f"not a recorded value: an object with keys {sorted(data)}")
    ((kind, body),) = data.items()
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise ValueError(f"not a recorded value: an object of kind {kind!r}")
    return decoder(body)


def _record(fields: dict[str, Any]) -> Record:
    out = Record()
    for name, value in fields.items():
        setattr(out, name, decode(value))
    return out


def _variant(body: list[Any]) -> Variant:
    tag, payload = body
    return Variant(tag, decode(payload))


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "bytes": lambda body: base64.b64decode(body, validate=True),
    "tuple": lambda body: tuple(decode(v) for v in body),
    "record": _record,
    "variant": _variant,
    "ok": lambda body: Ok(decode(body)),
    "err": lambda body: Err(decode(body)),
}


def dumps(data: Any) -> str:
    """Encoded data as compact JSON text (ASCII, so its length is its size in bytes)."""
    return json.dumps(data, separators=(",", ":"))


@frozen
class RecordedRaise:
    """What a host function raised instead of returning: it traps the guest (GuestStopped keeps
    its status: killed, timeout, ...)."""

    kind: str
    message: str
    status: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> RecordedRaise:
        status = exc.status if isinstance(exc, GuestStopped) else None
        message = exc.reason if isinstance(exc, GuestStopped) else str(exc)
        return cls(type(exc).__name__, message, status)

    def encode(self) -> dict[str, Any]:
        return {"raise": {"kind": self.kind, "message": self.message, "status": self.status}}

    @classmethod
    def decode(cls, data: Any) -> RecordedRaise | None:
        """The raise `data` records, or None when it records a value."""
        if not (isinstance(data, dict) and set(data) == {"raise"}):
            return None
        body = data["raise"]
        return cls(str(body["kind"]), str(body["message"]), body.get("status"))

    def exception(self) -> BaseException:
        if self.status is not None:
            return GuestStopped(self.status, self.message)  # type: ignore[arg-type]
        return ReplayedRaise(f"{self.kind}: {self.message}")


class ReplayedRaise(Exception):
    """A host function's recorded exception, raised again in replay (it traps the guest)."""
