"""Events as the ring keeps them: nested tuples of numbers and strings, which the cyclic garbage
collector stops tracking, rather than objects it would walk on every full collection for as
long as the ring holds them (about 50 for one pass of 16 lanes)."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

import attrs

from pie.events.sampling import TokenOutput

Packer = Callable[[Any], Any]

_CLASSES: list[type] = []
"""Every attrs class met so far; a packed instance starts with its index here."""
_PACKERS: dict[type, Packer] = {}
_UNPACKERS: dict[type, Callable[[tuple[Any, ...]], Any]] = {}


class Loose:
    """An event that is not an attrs instance, kept as it is (the ring then tracks it)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def pack(event: Any) -> Any:
    """`event` as nested tuples (`unpack` gives back an equal event)."""
    packer = _PACKERS.get(type(event))
    if packer is None:
        if not attrs.has(type(event)):
            return Loose(event)
        packer = _packer_of(type(event))
    return packer(event)


def packed_kind(packed: Any) -> type:
    """The class of the event `packed` holds, read without unpacking it."""
    if isinstance(packed, Loose):
        return type(packed.value)
    return _CLASSES[packed[0]]


def unpack(packed: Any) -> Any:
    if isinstance(packed, Loose):
        return packed.value
    return _unpack_instance(packed)


def _unpack_instance(packed: tuple[Any, ...]) -> Any:
    cls = _CLASSES[packed[0]]
    unpacker = _UNPACKERS.get(cls) or _unpacker_of(cls)
    return unpacker(packed)


def classes_from(start: int) -> list[type]:
    """The classes packed instances may name, from index `start` on (a process that unpacks
    what this one packed adopts them, in order)."""
    return _CLASSES[start:]


def adopt(classes: list[type]) -> None:
    """Takes the next classes of another process's packing, so that instances it packed
    unpack here. Only for a process that unpacks and never packs."""
    _CLASSES.extend(classes)


def _packer_of(cls: type) -> Packer:
    """Packs an instance of `cls` as (its index, each field packed as its type says)."""
    index = len(_CLASSES)
    _CLASSES.append(cls)
    names, codecs = _fields_of(cls)
    packer = _compiled_packer(cls, index, names, [c and c[0] for c in codecs])
    _PACKERS[cls] = packer
    return packer


def _fields_of(cls: type) -> tuple[tuple[str, ...], list[tuple[Packer, Packer] | None]]:
    """The names of `cls`'s fields, and how each is packed and unpacked (`_field_codec`)."""
    attrs.resolve_types(cls)
    fields = attrs.fields(cls)
    return tuple(f.name for f in fields), [_field_codec(f.type) for f in fields]


def _unpacker_of(cls: type) -> Callable[[tuple[Any, ...]], Any]:
    """Makes an instance of `cls` from what its packer made."""
    names, codecs = _fields_of(cls)
    unhooks = [(i + 1, codec[1]) for i, codec in enumerate(codecs) if codec is not None]

    def unpacker(packed: tuple[Any, ...]) -> Any:
        values = list(packed)
        for i, hook in unhooks:
            values[i] = hook(values[i])
        return cls(**dict(zip(names, values[1:], strict=True)))

    _UNPACKERS[cls] = unpacker
    return unpacker


def _compiled_packer(
    cls: type, index: int, names: tuple[str, ...], hooks: list[Packer | None]
) -> Packer:
    """One function that reads every field and packs it in place: a call per instance (and
    one per nested instance), where a generic loop over the fields costs several. A tuple of
    instances of several classes is packed item by item through `_pack_instance`."""
    scope: dict[str, Any] = {"_pack_instance": _pack_instance, "TokenOutput": TokenOutput}
    parts = []
    for i, (name, hook) in enumerate(zip(names, hooks, strict=True)):
        if hook is None:
            parts.append(f"value.{name}")
        elif hook is _pack_union_items:
            # A lane pass's outputs are one sampled token: packed in place, with no call.
            items = f"value.{name}"
            token = f"(({_index_of(TokenOutput)}, {items}[0].token),)"
            sampled = f"len({items}) == 1 and type({items}[0]) is TokenOutput"
            parts.append(f"({token} if {sampled} else tuple(map(_pack_instance, {items})))")
        else:
            scope[f"hook{i}"] = hook
            parts.append(f"hook{i}(value.{name})")
    source = f"def pack_{cls.__name__}(value):\n    return ({index}, {', '.join(parts)})\n"
    exec(compile(source, f"<packer of {cls.__qualname__}>", "exec"), scope)
    packer: Packer = scope[f"pack_{cls.__name__}"]
    return packer


def _index_of(cls: type) -> int:
    """The index `cls`'s packed instances start with (its packer made if need be)."""
    if cls not in _PACKERS:
        _packer_of(cls)
    return _CLASSES.index(cls)


def _members(tp: Any) -> tuple[Any, ...]:
    """The types a union stands for (the type itself otherwise)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _holds_instances(tp: Any) -> bool:
    return any(isinstance(m, type) and attrs.has(m) for m in _members(tp))


def _item_type(tp: Any) -> Any:
    """The item type of `tuple[X, ...]`, else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _field_codec(tp: Any) -> tuple[Packer, Packer] | None:
    """How a field of type `tp` is packed and unpacked; None when it is kept as it is
    (numbers, strings, bytes and tuples of them)."""
    if _holds_instances(tp):
        return _pack_instance, _unpack_optional
    item = _item_type(tp)
    if item is not None and _holds_instances(item):
        return _pack_each(item), lambda values: tuple(map(_unpack_instance, values))
    return None


def _pack_union_items(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """A tuple of instances of several classes; compiled packers inline it (`map` over
    `_pack_instance`)."""
    return tuple(map(_pack_instance, values))


def _pack_each(item: Any) -> Packer:
    """Packs a tuple of `item`s with one call per item, for the lanes of every pass: through
    map rather than a generator, and, for items of one class, that class's packer (looked up
    at the first tuple, since a class may be packed as a field of itself)."""
    if len(_members(item)) > 1:
        return _pack_union_items
    found: list[Packer] = []

    def pack_all(values: tuple[Any, ...]) -> tuple[Any, ...]:
        if not found:
            found.append(_PACKERS.get(item) or _packer_of(item))
        return tuple(map(found[0], values))

    return pack_all


def _pack_instance(value: Any) -> Any:
    if value is None:
        return None
    packer = _PACKERS.get(type(value)) or _packer_of(type(value))
    return packer(value)


def _unpack_optional(packed: Any) -> Any:
    return None if packed is None else _unpack_instance(packed)
