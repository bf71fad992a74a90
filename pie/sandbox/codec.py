"""Converters between wasmtime's C component values and Python, built once per type.

Python shapes match wasmtime-py (Record, Variant only when a variant is ambiguous, bytes for
list<u8>); numeric lists cross in bulk through numpy instead of one element at a time."""

from __future__ import annotations

import ctypes
import operator
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from attrs import frozen
from wasmtime import StoreContext
from wasmtime import _ffi as ffi
from wasmtime.component import _types as wt

Lift = Callable[[Any], Any]
"""Reads a `wasmtime_component_val_t` (borrowed: the C side frees it after the call)."""
Lower = Callable[[Any, Any], None]
"""Writes a Python value into a `wasmtime_component_val_t` the C side takes over. A value
that does not fit raises before anything is attached to the destination, so a half-built
value is leaked, never freed twice (only host bugs get there)."""

_VAL = ffi.wasmtime_component_val_t
_VAL_SIZE = ctypes.sizeof(_VAL)
_PAYLOAD_OFFSET = _VAL.of.offset
_BULK_MIN = 16
"""Below this many elements a plain loop beats setting up numpy views."""

# A private prototype that takes `bytes` as they are (wasmtime-py's copies them through a
# ctypes buffer first); wasmtime's own prototype object stays untouched.
_byte_vec_new = ffi.dll["wasm_byte_vec_new"]
_byte_vec_new.restype = None
_byte_vec_new.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_val_new = ffi.wasmtime_component_val_new


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


def _kind(name: str) -> int:
    return int(getattr(ffi, f"WASMTIME_COMPONENT_{name}").value)


K_STRING, K_LIST, K_RECORD = map(_kind, ("STRING", "LIST", "RECORD"))
K_VARIANT, K_OPTION, K_RESULT = map(_kind, ("VARIANT", "OPTION", "RESULT"))
_DELEGATED_KINDS = {
    wt.Char: _kind("CHAR"),
    wt.EnumType: _kind("ENUM"),
    wt.TupleType: _kind("TUPLE"),
    wt.FlagsType: _kind("FLAGS"),
    wt.OwnType: _kind("RESOURCE"),
    wt.BorrowType: _kind("RESOURCE"),
}


class _Number(NamedTuple):
    kind: int
    field: str
    """The member of the C value union."""
    dtype: str
    accepts: tuple[type, ...]
    bounds: tuple[int, int] | None


def _int(kind: str, dtype: str, low: int, high: int) -> _Number:
    return _Number(_kind(kind), kind.lower(), dtype, (int,), (low, high))


_NUMBERS: dict[type, _Number] = {
    wt.Bool: _Number(_kind("BOOL"), "boolean", "?", (bool,), None),
    wt.S8: _int("S8", "i1", -(2**7), 2**7 - 1),
    wt.U8: _int("U8", "u1", 0, 2**8 - 1),
    wt.S16: _int("S16", "<i2", -(2**15), 2**15 - 1),
    wt.U16: _int("U16", "<u2", 0, 2**16 - 1),
    wt.S32: _int("S32", "<i4", -(2**31), 2**31 - 1),
    wt.U32: _int("U32", "<u4", 0, 2**32 - 1),
    wt.S64: _int("S64", "<i8", -(2**63), 2**63 - 1),
    wt.U64: _int("U64", "<u8", 0, 2**64 - 1),
    wt.F32: _Number(_kind("F32"), "f32", "<f4", (float, int), None),
    wt.F64: _Number(_kind("F64"), "f64", "<f8", (float, int), None),
}


def _check_kind(c: Any, kind: int) -> None:
    if c.kind != kind:
        raise ValueMismatch(f"value of kind {c.kind}, expected {kind}")


def _wit(ty: wt.ValType) -> str:
    return type(ty).__name__.removesuffix("Type").lower()


def _classes(ty: wt.ValType | None) -> tuple[type, ...]:
    """The Python classes a case lifts to (wasmtime-py decides tags and cases by them)."""
    found: set[type] = {object} if ty is None else set()
    if ty is not None:
        ty.add_classes(found)
    return tuple(found)


def _cases(ty: wt.VariantLikeType) -> list[tuple[str, wt.ValType | None]]:
    return ty._cases()


# -- lifting ---------------------------------------------------------------------------------


def lifter(ty: wt.ValType) -> Lift:
    number = _NUMBERS.get(type(ty))
    if number is not None:
        return _lift_number(number.kind, number.field)
    match ty:
        case wt.String():
            return _lift_string
        case wt.ListType():
            return _lift_list(ty.element)
        case wt.RecordType():
            return _lift_record(ty.fields)
        case wt.OptionType() | wt.ResultType() | wt.VariantType():
            return _lift_variant_like(ty)
    return _lift_delegated(ty)


def _lift_number(kind: int, field: str) -> Lift:
    def lift(c: Any) -> Any:
        if c.kind != kind:
            raise ValueMismatch(f"value of kind {c.kind}, expected {kind}")
        return getattr(c.of, field)

    return lift


def _bytes_of(vec: Any) -> bytes:
    return ctypes.string_at(vec.data, vec.size) if vec.size else b""


def _lift_string(c: Any) -> str:
    _check_kind(c, K_STRING)
    return _bytes_of(c.of.string).decode("utf-8")


def _element_view(data: Any, n: int, dtype: np.dtype) -> np.ndarray:
    buffer = (ctypes.c_char * (n * _VAL_SIZE)).from_address(ctypes.addressof(data.contents))
    return np.frombuffer(memoryview(buffer), dtype=dtype)


def _val_dtype(fmt: str) -> np.dtype:
    return np.dtype(
        {
            "names": ["kind", "v"],
            "formats": ["u1", fmt],
            "offsets": [0, _PAYLOAD_OFFSET],
            "itemsize": _VAL_SIZE,
        }
    )


def _lift_list(element: wt.ValType) -> Lift:
    lift_one = lifter(element)
    number = _NUMBERS.get(type(element))
    is_bytes = isinstance(element, wt.U8)
    dtype = _val_dtype(number.dtype) if number else None
    kind = number.kind if number else -1

    def lift(c: Any) -> Any:
        _check_kind(c, K_LIST)
        n, data = c.of.list.size, c.of.list.data
        if dtype is None or n < _BULK_MIN:
            items = [lift_one(data[i]) for i in range(n)]
            return bytes(items) if is_bytes else items
        view = _element_view(data, n, dtype)
        if not (view["kind"] == kind).all():
            raise ValueMismatch("list elements of another kind")
        return view["v"].tobytes() if is_bytes else view["v"].tolist()

    return lift


def _lift_record(fields: list[tuple[str, wt.ValType]]) -> Lift:
    plan = [(name, lifter(ty)) for name, ty in fields]

    def lift(c: Any) -> Any:
        _check_kind(c, K_RECORD)
        rec = c.of.record
        if rec.size != len(plan):
            raise ValueMismatch(f"record of {rec.size} fields, expected {len(plan)}")
        out = wt.Record()
        data = rec.data
        for i, (name, lift_field) in enumerate(plan):
            setattr(out, name, lift_field(data[i].val))
        return out

    return lift


def _lift_variant_like(ty: wt.VariantLikeType) -> Lift:
    plan = {name: (lifter(case) if case else None) for name, case in _cases(ty)}
    is_tagged = ty._tagged()
    read_case = _case_reader(ty, plan)

    def lift(c: Any) -> Any:
        tag, ptr = read_case(c)
        lift_case = plan[tag]
        if (lift_case is None) != (not ptr):
            raise ValueMismatch(f"case {tag} with a payload it should not have, or without one")
        payload = lift_case(ptr.contents) if lift_case else None
        return wt.Variant(tag, payload) if is_tagged else payload

    return lift


def _case_reader(ty: wt.VariantLikeType, plan: dict[str, Any]) -> Callable[[Any], Any]:
    """(tag, payload pointer) of an option, result or variant value."""

    def option(c: Any) -> Any:
        _check_kind(c, K_OPTION)
        ptr = c.of.option
        return ("some" if ptr else "none"), ptr

    def result(c: Any) -> Any:
        _check_kind(c, K_RESULT)
        res = c.of.result
        return ("ok" if res.is_ok else "err"), res.val

    def variant(c: Any) -> Any:
        _check_kind(c, K_VARIANT)
        tag = _bytes_of(c.of.variant.discriminant).decode("utf-8")
        if tag not in plan:
            raise ValueMismatch(f"unknown case {tag}")
        return tag, c.of.variant.val

    if isinstance(ty, wt.OptionType):
        return option
    return result if isinstance(ty, wt.ResultType) else variant


def _lift_delegated(ty: wt.ValType) -> Lift:
    """Rare types (char, enum, tuple, flags, resources): wasmtime-py's converter does them."""
    kind = _DELEGATED_KINDS.get(type(ty), -1)

    def lift(c: Any) -> Any:
        _check_kind(c, kind)
        return ty.convert_from_c(c)

    return lift


# -- lowering --------------------------------------------------------------------------------

call_context = threading.local()
"""`.ptr`: the store context of the host call running on this thread (resources need it)."""


def lowerer(ty: wt.ValType) -> Lower:
    number = _NUMBERS.get(type(ty))
    if number is not None:
        return _lower_number(_wit(ty), number)
    match ty:
        case wt.String():
            return _lower_string
        case wt.ListType():
            return _lower_list(ty.element)
        case wt.RecordType():
            return _lower_record(ty.fields)
        case wt.OptionType() | wt.ResultType() | wt.VariantType():
            return _lower_variant_like(ty)
    return _lower_delegated(ty)


def _lower_number(name: str, number: _Number) -> Lower:
    kind, field, _, accepts, bounds = number
    low, high = bounds or (0, 0)

    def lower(v: Any, dst: Any) -> None:
        value: Any = v  # stays Any: isinstance below would narrow `v` to object
        if not isinstance(v, accepts):
            raise TypeError(f"expected {accepts[0].__name__} for {name}, got {v!r}")
        if bounds is not None and not low <= value <= high:
            raise OverflowError(f"{v} does not fit in {name}")
        setattr(dst.of, field, v)
        dst.kind = kind

    return lower


def _name_vec(text: str) -> Any:
    data = text.encode("utf-8")
    vec = ffi.wasm_byte_vec_t()
    _byte_vec_new(ctypes.byref(vec), len(data), data)
    return vec


def _lower_string(v: Any, dst: Any) -> None:
    if not isinstance(v, str):
        raise TypeError(f"expected str for string, got {type(v).__name__}")
    dst.of.string = _name_vec(v)
    dst.kind = K_STRING


def _new_list(n: int) -> Any:
    raw = ffi.wasmtime_component_vallist_t()
    ffi.wasmtime_component_vallist_new_uninit(ctypes.byref(raw), n)
    return raw


def _numbers(v: Any, fmt: str, name: str) -> np.ndarray:
    """`v` as a numpy array of `fmt`, refusing values that would wrap."""
    values = np.asarray(v)
    if values.ndim != 1:
        raise TypeError(f"expected a flat sequence for list<{name}>")
    target = np.dtype(fmt)
    if values.dtype == target or values.size == 0:
        return values.astype(target, copy=False)
    if values.dtype.kind not in "iubf" or (target.kind in "iu" and values.dtype.kind == "f"):
        raise TypeError(f"expected numbers for list<{name}>, got {values.dtype}")
    if target.kind in "iu":
        info = np.iinfo(target)
        if int(values.min()) < info.min or int(values.max()) > info.max:
            raise OverflowError(f"values outside {name} in list<{name}>")
    return values.astype(target)


def _lower_list(element: wt.ValType) -> Lower:
    lower_one = lowerer(element)
    number = _NUMBERS.get(type(element))
    is_bytes = isinstance(element, wt.U8)
    dtype = _val_dtype(number.dtype) if number else None
    name = _wit(element)

    def lower(v: Any, dst: Any) -> None:
        if is_bytes and not isinstance(v, bytes | bytearray | memoryview):
            raise TypeError(f"expected bytes for list<u8>, got {type(v).__name__}")
        if not is_bytes and not isinstance(v, list | tuple | np.ndarray):
            raise TypeError(f"expected a list for list<{name}>, got {type(v).__name__}")
        n = len(v)
        raw = _new_list(n)
        if dtype is None or n < _BULK_MIN:
            data = raw.data
            for i, item in enumerate(v):
                lower_one(item, data[i])
        else:
            assert number is not None
            values = np.frombuffer(v, np.uint8) if is_bytes else _numbers(v, number.dtype, name)
            view = _element_view(raw.data, n, dtype)
            view["kind"] = number.kind
            view["v"] = values
        dst.of.list = raw
        dst.kind = K_LIST

    return lower


def _lower_record(fields: list[tuple[str, wt.ValType]]) -> Lower:
    plan = [(name, operator.attrgetter(name), lowerer(ty)) for name, ty in fields]

    def lower(v: Any, dst: Any) -> None:
        raw = ffi.wasmtime_component_valrecord_t()
        ffi.wasmtime_component_valrecord_new_uninit(ctypes.byref(raw), len(plan))
        data = raw.data
        for i, (name, get, lower_field) in enumerate(plan):
            entry = data[i]
            lower_field(get(v), entry.val)
            entry.name = _name_vec(name)
        dst.of.record = raw
        dst.kind = K_RECORD

    return lower


def _boxed(lower_case: Lower | None, payload: Any) -> Any:
    """A payload the C side owns through a pointer (NULL for a case without one)."""
    if lower_case is None:
        if payload is not None:
            raise TypeError(f"this case carries no payload, got {payload!r}")
        return None
    raw = _VAL()
    lower_case(payload, raw)
    return _val_new(ctypes.byref(raw))


def _choose_case(v: Any, plan: list[tuple[str, Lower | None, tuple[type, ...]]]) -> Any:
    """Untagged variants: the first case whose Python classes fit `v` (as wasmtime-py)."""
    for name, lower_case, accepted in plan:
        if lower_case is None and v is None:
            return name, None
        if lower_case is not None and isinstance(v, accepted):
            return name, lower_case
    raise TypeError(f"{v!r} fits none of the cases {[name for name, _, _ in plan]}")


def _lower_variant_like(ty: wt.VariantLikeType) -> Lower:
    cases = _cases(ty)
    plan = [(name, lowerer(c) if c else None, _classes(c)) for name, c in cases]
    by_tag = {name: lower_case for name, lower_case, _ in plan}
    is_tagged = ty._tagged()
    is_result = isinstance(ty, wt.ResultType)

    def lower(v: Any, dst: Any) -> None:
        if is_result and isinstance(v, Ok | Err):
            tag = "ok" if isinstance(v, Ok) else "err"
            lower_case, payload = by_tag[tag], v.value
        elif is_tagged:
            if not isinstance(v, wt.Variant) or v.tag not in by_tag:
                raise TypeError(f"expected Variant(tag, payload) with a tag in {list(by_tag)}")
            tag, lower_case, payload = v.tag, by_tag[v.tag], v.payload
        else:
            tag, lower_case = _choose_case(v, plan)
            payload = v
        _write_case(ty, tag, _boxed(lower_case, payload), dst)

    return lower


def _write_case(ty: wt.VariantLikeType, tag: str, ptr: Any, dst: Any) -> None:
    if isinstance(ty, wt.OptionType):
        dst.of.option = ptr
        dst.kind = K_OPTION
    elif isinstance(ty, wt.ResultType):
        dst.of.result.is_ok = tag == "ok"
        dst.of.result.val = ptr
        dst.kind = K_RESULT
    else:
        dst.of.variant.discriminant = _name_vec(tag)
        dst.of.variant.val = ptr
        dst.kind = K_VARIANT


def _lower_delegated(ty: wt.ValType) -> Lower:
    def lower(v: Any, dst: Any) -> None:
        store = StoreContext(call_context.ptr)
        try:
            ty.convert_to_c(store, v, ctypes.pointer(dst))
        finally:
            store._invalidate()

    return lower
