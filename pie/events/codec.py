"""The one cattrs converter: events <-> JSON-ready dicts tagged with their class name.

Used only at the edges (the event log, later the wire). Extra keys and values of the wrong
JSON type are refused (no silent coercion) and validation errors come back as readable paths.
"""

from __future__ import annotations

import base64
import binascii
import json
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import cattrs
from cattrs.cols import homogenous_tuple_structure_factory
from cattrs.gen import make_dict_structure_fn
from cattrs.preconf.json import make_converter
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception

from pie.events import ALL_EVENTS
from pie.events.batching import FormerStep
from pie.events.recording import HostCallsRecorded
from pie.events.sampling import SlotOp, SlotOutput, TokenOutput
from pie.events.speculation import LanePassApplied

TAG = "type"


class WrongType(TypeError):
    """A JSON value of the wrong kind where a field expects another (the text says which)."""


def _exact(*kinds: type) -> Callable[[Any, Any], Any]:
    # bool is an int in Python but never in JSON, so it is matched by exact type.
    names = " or ".join(k.__name__ for k in kinds)

    def structure(value: Any, _: Any) -> Any:
        if type(value) not in kinds:
            raise WrongType(f"expected {names}, got {type(value).__name__}")
        return kinds[0](value)

    return structure


def _is_homogeneous_tuple(cl: Any) -> bool:
    args = typing.get_args(cl)
    return typing.get_origin(cl) is tuple and len(args) == 2 and args[1] is Ellipsis


def _array_tuple(cl: Any, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    items = homogenous_tuple_structure_factory(cl, conv)

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, list | tuple):
            raise WrongType(f"expected an array, got {type(value).__name__}")
        return items(value, cl)

    return structure


def _tagged(union: Any, conv: cattrs.Converter) -> None:
    configure_tagged_union(union, conv, tag_name=TAG)
    members = conv.get_structure_hook(union)
    tags = sorted(cls.__name__ for cls in typing.get_args(union))

    def structure(value: Any, cl: Any) -> Any:
        if not isinstance(value, dict):
            raise WrongType(f"expected an object, got {type(value).__name__}")
        if value.get(TAG) not in tags:
            known = ", ".join(tags)
            raise WrongType(f"unknown {TAG!r} {value.get(TAG)!r}, expected one of {known}")
        return members(value, cl)

    conv.register_structure_hook(union, structure)


def _bytes_from_base64(value: Any, _: Any) -> bytes:
    if type(value) is not str:
        raise WrongType(f"expected a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise WrongType("expected a base64 string (standard alphabet, padded)") from None


converter = make_converter(forbid_extra_keys=True)
# Standard base64: readable by every JSON client and C-fast here (base85 is pure Python).
converter.register_unstructure_hook(bytes, lambda value: base64.b64encode(value).decode())
converter.register_structure_hook(bytes, _bytes_from_base64)
converter.register_structure_hook(int, _exact(int))
converter.register_structure_hook(float, _exact(float, int))
converter.register_structure_hook(str, _exact(str))
converter.register_structure_hook(bool, _exact(bool))
converter.register_structure_hook_factory(_is_homogeneous_tuple, _array_tuple)
_tagged(SlotOp, converter)
_tagged(SlotOutput, converter)
_tagged(FormerStep, converter)


def _positional_items(cls: type, conv: cattrs.Converter) -> None:
    """Encodes the items of a `tuple[cls, ...]` field as arrays of their fields in order
    rather than objects: for records that come by the dozen in every pass, where the keys
    would be most of the bytes and most of the encoding time. An item is decoded through the
    class's object decoder, so every check (and every error path) stays as it is; objects
    (and `cls` on its own, which stays an object) are still read."""
    attrs.resolve_types(cls)
    fields = attrs.fields(cls)
    names = tuple(f.name for f in fields)
    plain = {int, bool, str, float}
    by_field: Callable[[Any, Any], Any] = make_dict_structure_fn(
        cls, conv, _cattrs_forbid_extra_keys=True
    )
    compiled: list[Callable[[tuple[Any, ...]], list[list[Any]]]] = []

    def unstructure(values: tuple[Any, ...]) -> list[list[Any]]:
        if not compiled:  # built once every field's hook is registered
            compiled.append(_items_encoder(cls, conv, plain))
        return compiled[0](values)

    def structure(value: Any, _: Any) -> Any:
        if isinstance(value, dict):
            return by_field(value, cls)
        if not isinstance(value, list):
            raise WrongType(f"expected an array of {', '.join(names)}, got {type(value).__name__}")
        if len(value) != len(names):
            raise WrongType(f"expected {len(names)} items ({', '.join(names)}), got {len(value)}")
        return by_field(dict(zip(names, value, strict=True)), cls)

    items = tuple[cls, ...]  # type: ignore[valid-type]
    conv.register_unstructure_hook_func(lambda t: t == items, unstructure)
    conv.register_structure_hook(cls, structure)


def _items_encoder(
    cls: type, conv: cattrs.Converter, plain: set[type]
) -> Callable[[tuple[Any, ...]], list[list[Any]]]:
    """One comprehension that writes every item's fields in order: no call per item for plain
    fields, or for outputs that are one sampled token (a lane pass's), built in place."""
    scope: dict[str, Any] = {"TokenOutput": TokenOutput}
    parts = []
    for i, f in enumerate(attrs.fields(cls)):
        value = f"v.{f.name}"
        if f.type in plain:
            parts.append(value)
            continue
        scope[f"hook{i}"] = conv.get_unstructure_hook(f.type)
        if f.type == tuple[SlotOutput, ...]:
            one = f'[{{"token": {value}[0].token, "{TAG}": "TokenOutput"}}]'
            sampled = f"len({value}) == 1 and type({value}[0]) is TokenOutput"
            parts.append(f"({one} if {sampled} else hook{i}({value}))")
        else:
            parts.append(f"hook{i}({value})")
    source = f"def encode_items(values):\n    return [[{', '.join(parts)}] for v in values]\n"
    exec(compile(source, f"<items of {cls.__qualname__}>", "exec"), scope)
    encoder: Callable[[tuple[Any, ...]], list[list[Any]]] = scope["encode_items"]
    return encoder


_positional_items(LanePassApplied, converter)


def _sampled_tokens(conv: cattrs.Converter) -> None:
    """Encodes a `tuple[SlotOutput, ...]` with each sampled token's object built in place (the
    tagged union's own encoder for the other outputs): every lane pass of every pass carries
    one, and the generic path costs five calls an item. The objects are the same."""
    member = conv.get_unstructure_hook(SlotOutput)

    def unstructure(values: tuple[Any, ...]) -> list[Any]:
        return [
            {"token": v.token, TAG: "TokenOutput"} if type(v) is TokenOutput else member(v)
            for v in values
        ]

    outputs = tuple[SlotOutput, ...]
    conv.register_unstructure_hook_func(lambda t: t == outputs, unstructure)


_sampled_tokens(converter)


def _calls_as_text(conv: cattrs.Converter) -> None:
    """The event log writes recorded calls as the JSON array they are; the event holds them as
    text, written back exactly as the recorder wrote it (same separators, ASCII)."""
    by_field = make_dict_structure_fn(HostCallsRecorded, conv, _cattrs_forbid_extra_keys=True)

    def structure(value: Any, _: Any) -> HostCallsRecorded:
        if isinstance(value, dict) and isinstance(value.get("calls"), list):
            value = {**value, "calls": json.dumps(value["calls"], separators=(",", ":"))}
        return by_field(value, HostCallsRecorded)

    conv.register_structure_hook(HostCallsRecorded, structure)


_calls_as_text(converter)

_BY_NAME: dict[str, type] = {cls.__name__: cls for cls in ALL_EVENTS}


class DecodeError(ValueError):
    """A message that is not a well-formed event; the text names every bad field."""


def encode(event: Any) -> dict[str, Any]:
    """An event as a dict with its class name under "type"."""
    data = converter.unstructure(event)
    return {TAG: type(event).__name__, **data}


def decode(data: Any, by_name: Mapping[str, type] | None = None, what: str = "event") -> Any:
    """The event (or, with `by_name`, the message of another closed set) a dict made by
    `encode` describes."""
    if not isinstance(data, dict):
        raise DecodeError(f"expected an object, got {type(data).__name__}")
    fields = dict(data)
    name = fields.pop(TAG, None)
    cls = (by_name or _BY_NAME).get(name) if isinstance(name, str) else None
    if cls is None:
        raise DecodeError(f"unknown {what} type {name!r}")
    try:
        return converter.structure(fields, cls)
    except Exception as exc:  # cattrs raises ClassValidationError groups and plain errors
        raise DecodeError(f"bad {name}: {'; '.join(_messages(exc))}") from exc


def by_name(classes: Iterable[type]) -> dict[str, type]:
    """A closed set of message classes keyed by their tag, for `decode`."""
    return {cls.__name__: cls for cls in classes}


def register_tagged_union(union: Any) -> None:
    """Fields typed with `union` (of attrs classes) are encoded with the class name as tag."""
    _tagged(union, converter)


def dumps(event: Any) -> str:
    return json.dumps(encode(event), separators=(",", ":"))


def loads(text: str | bytes) -> Any:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DecodeError(f"not JSON: {exc}") from exc
    return decode(data)


def _messages(exc: BaseException) -> list[str]:
    if isinstance(exc, cattrs.BaseValidationError):
        return cattrs.transform_error(exc, format_exception=_describe)
    return [str(exc)]


def _describe(exc: BaseException, cl: type | None) -> str:
    if isinstance(exc, WrongType):
        return str(exc)
    if isinstance(exc, ValueError) and cl is None:
        return f"invalid value ({exc})"
    return format_exception(exc, cl)
