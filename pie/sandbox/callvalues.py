"""Host-call values as JSON, losslessly: what host functions take and return (records,
variants, `Ok`/`Err`, bytes, tuples, numbers, lists) and what one raised, for recorded calls.

Numbers, strings, booleans, null and lists are themselves; everything else is an object with
one key that names its kind: `{"bytes": base64}`, `{"tuple": [...]}`, `{"record": {...}}`,
`{"variant": [tag, payload]}`, `{"ok": v}`, `{"err": v}`, `{"raise": {...}}`."""

from __future__ import annotations

import base64
import json
import operator
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
    """`value` as JSON-ready data (numpy scalars inside a list of numbers are left to `dumps`)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is list:
        # A WIT list is homogeneous: one that starts with a number or a string holds only those.
        if value and type(value[0]) in _SCALARS:
            return value
        return [encode(v) for v in value]
    tagged = _TAGGED.get(kind)
    if tagged is not None:
        return tagged(value)
    return _encode_other(value)


def encode_args(args: tuple[Any, ...] | list[Any]) -> list[Any]:
    """A host call's arguments (of mixed kinds, unlike a WIT list) as JSON-ready data."""
    return [encode(a) for a in args]


def _encode_record(value: Record) -> Any:
    return {"record": {name: encode(v) for name, v in vars(value).items()}}


def _encode_bytes(value: bytes | bytearray | memoryview) -> Any:
    return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}


_SCALARS = frozenset({int, float, str, bool})
_PLAIN = _SCALARS | {type(None)}
_TAGGED: dict[type, Callable[[Any], Any]] = {
    tuple: lambda value: {"tuple": [encode(v) for v in value]},
    Record: _encode_record,
    Variant: lambda value: {"variant": [value.tag, encode(value.payload)]},
    Ok: lambda value: {"ok": encode(value.value)},
    Err: lambda value: {"err": encode(value.value)},
    bytes: _encode_bytes,
    bytearray: _encode_bytes,
    memoryview: _encode_bytes,
}
"""How each kind of value with a tag is encoded, found by its exact type (the common case)."""


def _encode_other(value: Any) -> Any:
    """Subclasses of the kinds above, and numpy values (lowered as the lists they hold)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    for kind, tagged in _TAGGED.items():
        if isinstance(value, kind):
            return tagged(value)
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [encode(v) for v in value]
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
    return _JSON.encode(data)


def _late(value: Any) -> Any:
    """What `dumps` meets that `encode` passed through: numpy scalars in a list of numbers."""
    if isinstance(value, np.generic):
        return value.item()
    raise Unrecordable(f"a host call carried a {type(value).__name__}, which cannot be recorded")


_JSON = json.JSONEncoder(separators=(",", ":"), default=_late, check_circular=False)

TUPLE_CALLS = frozenset({"media.info"})
"""The host calls whose values hold a WIT tuple (`media-info.grid`): JSON's encoder writes a
Python tuple as an array, so only these need the walk of `encode`, which tags tuples."""


def dumps_call(fn: str, args: tuple[Any, ...], result: Any) -> str:
    """One recorded call, [function, arguments, result], as `dumps` of `encode` would write
    it. Calls without tuples take one pass of JSON's C encoder, which hands only the tagged
    kinds to Python, one level at a time."""
    if fn in TUPLE_CALLS:
        return _JSON.encode([fn, encode_args(args), encode(result)])
    return _TAGGING_JSON.encode([fn, list(args), result])


_CALL_NAME = operator.itemgetter(0)


def dumps_calls(calls: list[tuple[str, tuple[Any, ...], Any]]) -> str:
    """Several recorded calls as the JSON array of what `dumps_call` writes for each, in one
    pass of the C encoder where none carries a tuple: one pass over many calls runs on warm
    caches, where a call encoded on its own, between stretches of guest code, costs a few
    times more."""
    if not TUPLE_CALLS.isdisjoint(map(_CALL_NAME, calls)):
        return "[" + ",".join(dumps_call(fn, args, result) for fn, args, result in calls) + "]"
    return _TAGGING_JSON.encode([[fn, list(args), result] for fn, args, result in calls])


def _tag(value: Any) -> Any:
    kind = type(value)
    if kind is Record:
        return {"record": vars(value)}
    if kind is Variant:
        return {"variant": [value.tag, value.payload]}
    if kind is Ok:
        return {"ok": value.value}
    if kind is Err:
        return {"err": value.value}
    if kind is RecordedRaise:
        return value.encode()
    return encode(value)


_TAGGING_JSON = json.JSONEncoder(separators=(",", ":"), default=_tag, check_circular=False)


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


_TAGGED[RecordedRaise] = RecordedRaise.encode


class ReplayedRaise(Exception):
    """A host function's recorded exception, raised again in replay (it traps the guest)."""
