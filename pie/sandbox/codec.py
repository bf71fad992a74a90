"""Converters between wasmtime's C component values and Python, built once per type.

Python shapes match wasmtime-py (Record, Variant only when a variant is ambiguous, bytes for
list<u8>); numeric lists cross in bulk through numpy instead of one element at a time."""

from __future__ import annotations

import ctypes
import operator
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from wasmtime import StoreContext
from wasmtime import _ffi as ffi
from wasmtime.component import _types as wt

from pie.sandbox.values import (
    BULK_MIN,
    DELEGATED_KINDS,
    K_LIST,
    K_OPTION,
    K_RECORD,
    K_RESULT,
    K_STRING,
    K_VARIANT,
    NUMBERS,
    PAYLOAD_OFFSET,
    VAL,
    VAL_SIZE,
    Err,
    Lift,
    Lower,
    Number,
    Ok,
    ValueMismatch,
    byte_vec_new,
    cases_of,
    check_kind,
    classes_of,
    val_new,
    wit_name,
)

# -- lifting ---------------------------------------------------------------------------------


def lifter(ty: wt.ValType) -> Lift:
    number = NUMBERS.get(type(ty))
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
    check_kind(c, K_STRING)
    return _bytes_of(c.of.string).decode("utf-8")


def _element_view(data: Any, n: int, dtype: np.dtype) -> np.ndarray:
    buffer = (ctypes.c_char * (n * VAL_SIZE)).from_address(ctypes.addressof(data.contents))
    return np.frombuffer(memoryview(buffer), dtype=dtype)


def _val_dtype(fmt: str) -> np.dtype:
    return np.dtype(
        {
            "names": ["kind", "v"],
            "formats": ["u1", fmt],
            "offsets": [0, PAYLOAD_OFFSET],
            "itemsize": VAL_SIZE,
        }
    )


def _lift_list(element: wt.ValType) -> Lift:
    lift_one = lifter(element)
    number = NUMBERS.get(type(element))
    is_bytes = isinstance(element, wt.U8)
    dtype = _val_dtype(number.dtype) if number else None
    kind = number.kind if number else -1

    def lift(c: Any) -> Any:
        check_kind(c, K_LIST)
        n, data = c.of.list.size, c.of.list.data
        if dtype is None or n < BULK_MIN:
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
        check_kind(c, K_RECORD)
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
    plan = {name: (lifter(case) if case else None) for name, case in cases_of(ty)}
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
        check_kind(c, K_OPTION)
        ptr = c.of.option
        return ("some" if ptr else "none"), ptr

    def result(c: Any) -> Any:
        check_kind(c, K_RESULT)
        res = c.of.result
        return ("ok" if res.is_ok else "err"), res.val

    def variant(c: Any) -> Any:
        check_kind(c, K_VARIANT)
        tag = _bytes_of(c.of.variant.discriminant).decode("utf-8")
        if tag not in plan:
            raise ValueMismatch(f"unknown case {tag}")
        return tag, c.of.variant.val

    if isinstance(ty, wt.OptionType):
        return option
    return result if isinstance(ty, wt.ResultType) else variant


def _lift_delegated(ty: wt.ValType) -> Lift:
    """Rare types (char, enum, tuple, flags, resources): wasmtime-py's converter does them."""
    kind = DELEGATED_KINDS.get(type(ty), -1)

    def lift(c: Any) -> Any:
        check_kind(c, kind)
        return ty.convert_from_c(c)

    return lift


# -- lowering --------------------------------------------------------------------------------

call_context = threading.local()
"""`.ptr`: the store context of the host call running on this thread (resources need it)."""


def lowerer(ty: wt.ValType) -> Lower:
    number = NUMBERS.get(type(ty))
    if number is not None:
        return _lower_number(wit_name(ty), number)
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


def _lower_number(name: str, number: Number) -> Lower:
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
    byte_vec_new(ctypes.byref(vec), len(data), data)
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
    number = NUMBERS.get(type(element))
    is_bytes = isinstance(element, wt.U8)
    dtype = _val_dtype(number.dtype) if number else None
    name = wit_name(element)

    def lower(v: Any, dst: Any) -> None:
        if is_bytes and not isinstance(v, bytes | bytearray | memoryview):
            raise TypeError(f"expected bytes for list<u8>, got {type(v).__name__}")
        if not is_bytes and not isinstance(v, list | tuple | np.ndarray):
            raise TypeError(f"expected a list for list<{name}>, got {type(v).__name__}")
        n = len(v)
        raw = _new_list(n)
        if dtype is None or n < BULK_MIN:
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
    raw = VAL()
    lower_case(payload, raw)
    return val_new(ctypes.byref(raw))


def _choose_case(v: Any, plan: list[tuple[str, Lower | None, tuple[type, ...]]]) -> Any:
    """Untagged variants: the first case whose Python classes fit `v` (as wasmtime-py)."""
    for name, lower_case, accepted in plan:
        if lower_case is None and v is None:
            return name, None
        if lower_case is not None and isinstance(v, accepted):
            return name, lower_case
    raise TypeError(f"{v!r} fits none of the cases {[name for name, _, _ in plan]}")


def _lower_variant_like(ty: wt.VariantLikeType) -> Lower:
    cases = cases_of(ty)
    plan = [(name, lowerer(c) if c else None, classes_of(c)) for name, c in cases]
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
