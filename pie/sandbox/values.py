"""The vocabulary the value converters share: the `Ok`/`Err` a host function returns, the C
value kinds, the table of numeric types, and how wasmtime-py picks a variant's case."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NamedTuple

from attrs import frozen
from wasmtime import _ffi as ffi
from wasmtime.component import _types as wt

Lift = Callable[[Any], Any]
"""Reads a `wasmtime_component_val_t` (borrowed: the C side frees it after the call)."""
Lower = Callable[[Any, Any], None]
"""Writes a Python value into a `wasmtime_component_val_t` the C side takes over. A value
that does not fit raises before anything is attached to the destination, so a half-built
value is leaked, never freed twice (only host bugs get there)."""

VAL = ffi.wasmtime_component_val_t
VAL_SIZE = ctypes.sizeof(VAL)
PAYLOAD_OFFSET = VAL.of.offset
BULK_MIN = 16
"""Below this many elements a plain loop beats setting up numpy views."""

# A private prototype that takes `bytes` as they are (wasmtime-py's copies them through a
# ctypes buffer first); wasmtime's own prototype object stays untouched.
byte_vec_new = ffi.dll["wasm_byte_vec_new"]
byte_vec_new.restype = None
byte_vec_new.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
val_new = ffi.wasmtime_component_val_new


@frozen
class Ok:
    """The `ok` case of a `result<T, E>` a host function returns."""

    value: Any = None


@frozen
class Err:
    """The `err` case of a `result<T, E>` a host function returns."""

    value: Any = None


class ValueMismatch(Exception):
    """A C value does not have the shape of the cached type (another signature reached us)."""


def kind_of(name: str) -> int:
    return int(getattr(ffi, f"WASMTIME_COMPONENT_{name}").value)


K_STRING, K_LIST, K_RECORD = map(kind_of, ("STRING", "LIST", "RECORD"))
K_VARIANT, K_OPTION, K_RESULT = map(kind_of, ("VARIANT", "OPTION", "RESULT"))
DELEGATED_KINDS = {
    wt.Char: kind_of("CHAR"),
    wt.EnumType: kind_of("ENUM"),
    wt.TupleType: kind_of("TUPLE"),
    wt.FlagsType: kind_of("FLAGS"),
    wt.OwnType: kind_of("RESOURCE"),
    wt.BorrowType: kind_of("RESOURCE"),
}


class Number(NamedTuple):
    kind: int
    field: str
    """The member of the C value union."""
    dtype: str
    accepts: tuple[type, ...]
    bounds: tuple[int, int] | None


def _int(kind: str, dtype: str, low: int, high: int) -> Number:
    return Number(kind_of(kind), kind.lower(), dtype, (int,), (low, high))


NUMBERS: dict[type, Number] = {
    wt.Bool: Number(kind_of("BOOL"), "boolean", "?", (bool,), None),
    wt.S8: _int("S8", "i1", -(2**7), 2**7 - 1),
    wt.U8: _int("U8", "u1", 0, 2**8 - 1),
    wt.S16: _int("S16", "<i2", -(2**15), 2**15 - 1),
    wt.U16: _int("U16", "<u2", 0, 2**16 - 1),
    wt.S32: _int("S32", "<i4", -(2**31), 2**31 - 1),
    wt.U32: _int("U32", "<u4", 0, 2**32 - 1),
    wt.S64: _int("S64", "<i8", -(2**63), 2**63 - 1),
    wt.U64: _int("U64", "<u8", 0, 2**64 - 1),
    wt.F32: Number(kind_of("F32"), "f32", "<f4", (float, int), None),
    wt.F64: Number(kind_of("F64"), "f64", "<f8", (float, int), None),
}


def check_kind(c: Any, kind: int) -> None:
    if c.kind != kind:
        raise ValueMismatch(f"value of kind {c.kind}, expected {kind}")


def wit_name(ty: wt.ValType) -> str:
    return type(ty).__name__.removesuffix("Type").lower()


def classes_of(ty: wt.ValType | None) -> tuple[type, ...]:
    """The Python classes a case lifts to (wasmtime-py decides tags and cases by them)."""
    found: set[type] = {object} if ty is None else set()
    if ty is not None:
        ty.add_classes(found)
    return tuple(found)


def cases_of(ty: wt.VariantLikeType) -> list[tuple[str, wt.ValType | None]]:
    return ty._cases()
