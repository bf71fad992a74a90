"""Config errors in a user's words: each names the table and the key, lists the table's keys
with the closest match for an unknown one, and says what type a key expects."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterator
from typing import Any

import attrs
from cattrs import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.errors import AttributeValidationNote, IterableValidationNote

Place = tuple[str | int, ...]
"""Names and indices from the top of the file: ("kv",), ("models", 0), ("mcp", "servers", 1)."""


class ConfigError(ValueError):
    """A config that could not be used; the message names the file (when there is one), the
    table and the key."""


def unknown_tables(data: dict[str, Any], config_class: type) -> list[str]:
    """One message per top-level name that is no table of `config_class`."""
    tables = [f.name for f in attrs.fields(config_class)]
    return [_unknown_table(name, tables, config_class) for name in data if name not in tables]


def _unknown_table(name: str, tables: list[str], config_class: type) -> str:
    holders = [
        table
        for table in tables
        if attrs.has(section := _section_class(config_class, table))
        and name in attrs.fields_dict(section)
    ]
    if holders:
        tables = [f"[{t}]" for t in holders]
        listed = tables[0] if len(tables) == 1 else f"{', '.join(tables[:-1])} and {tables[-1]}"
        hint = f"'{name}' is a key of {listed}; "
    else:
        hint = _did_you_mean(name, tables, "[{}]")
    return f"there is no table [{name}]; {hint}known tables: {', '.join(tables)}"


def describe(exc: BaseException) -> list[str]:
    """One message per problem cattrs found while structuring the config."""
    return list(_walk(exc, (), ()))


def _walk(exc: BaseException, table: Place, key: Place) -> Iterator[str]:
    if isinstance(exc, ClassValidationError | IterableValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            step = _step(note)
            if isinstance(sub, ClassValidationError):
                yield from _walk(sub, (*table, *key, step), ())
            elif isinstance(sub, IterableValidationError):
                yield from _walk(sub, table, (*key, step))
            else:
                yield _leaf(sub, note.type, table, (*key, step))
        for sub in without:
            yield from _table_problem(sub, table, exc.cl)
    else:
        yield f"{exc}"


def _step(note: AttributeValidationNote | IterableValidationNote) -> str | int:
    """A note's place: an attribute's name, or an item's index (or key)."""
    if isinstance(note, AttributeValidationNote):
        return note.name
    index: str | int = note.index  # the note's own field, not str.index
    return index


def _leaf(exc: BaseException, expected: Any, table: Place, key: Place) -> str:
    if attrs.has(expected):
        # A whole table: either its own check refused it, or it is not a table at all.
        where = (*table, *key)
        if isinstance(exc, ValueError):
            return _in_table(where, str(exc), expected)
        return f"{_label(where)} must be a table"
    if isinstance(exc, KeyError):
        return f"{_label(table)} needs the key '{_key(key)}'".lstrip()
    message = str(exc) if isinstance(exc, ValueError) and str(exc) else _expected(expected)
    return f"{_label(table)} {_key(key)}: {message}".lstrip()


def _table_problem(exc: BaseException, table: Place, cl: type) -> Iterator[str]:
    label = _label(table)
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)]
        for name in sorted(exc.extra_fields):
            hint = _did_you_mean(name, known, "'{}'")
            yield f"{label} has no key '{name}'; {hint}known keys: {', '.join(known)}"
    elif isinstance(exc, KeyError):
        yield f"{label} needs the key '{exc.args[0]}'"
    else:
        yield _in_table(table, str(exc), cl)


def _in_table(table: Place, message: str, cl: type) -> str:
    """A table's own check in the table's words: its message names the key (or the table)
    already, or else it follows the table's name."""
    label = _label(table)
    dotted = ".".join(str(p) for p in table if isinstance(p, str))
    if not label or message.startswith((f"{dotted}.", f"{dotted} ", f"[{dotted}]")):
        return message
    first = message.split(" ", 1)[0].rstrip(":").strip("'")
    if first in attrs.fields_dict(cl):
        return f"{label} {message}"
    return f"{label}: {message}"


def _did_you_mean(name: str, known: list[str], form: str) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"did you mean {form.format(close[0])}? " if close else ""


def _label(table: Place) -> str:
    if not table:
        return ""
    if isinstance(table[-1], int):
        return f"[[{'.'.join(map(str, table[:-1]))}]] entry {table[-1] + 1}"
    return f"[{'.'.join(map(str, table))}]"


def _key(key: Place) -> str:
    text = ""
    for part in key:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
    return text


def _expected(expected: Any) -> str:
    origin = typing.get_origin(expected) or expected
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if origin in names:
        return f"expected {names[origin]}"
    if origin in (tuple, list):
        return "expected a list"
    if origin is dict:
        return "expected a table"
    return f"expected {getattr(expected, '__name__', expected)}"


def _section_class(config_class: type, table: str) -> Any:
    kind = typing.get_type_hints(config_class)[table]
    return typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else kind
