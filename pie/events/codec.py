"""The one cattrs converter: events <-> JSON-ready dicts tagged with their class name.

Used only at the edges (the event log, later the wire). Extra keys are refused and
validation errors come back as readable paths.
"""

from __future__ import annotations

import json
from typing import Any

import cattrs
from cattrs.preconf.json import make_converter
from cattrs.strategies import configure_tagged_union

from pie.events import ALL_EVENTS
from pie.events.sampling import SlotOp, SlotOutput

TAG = "type"

converter = make_converter(forbid_extra_keys=True)
configure_tagged_union(SlotOp, converter, tag_name=TAG)
configure_tagged_union(SlotOutput, converter, tag_name=TAG)

_BY_NAME: dict[str, type] = {cls.__name__: cls for cls in ALL_EVENTS}


class DecodeError(ValueError):
    """A message that is not a well-formed event; the text names every bad field."""


def encode(event: Any) -> dict[str, Any]:
    """An event as a dict with its class name under "type"."""
    data = converter.unstructure(event)
    return {TAG: type(event).__name__, **data}


def decode(data: Any) -> Any:
    """The event a dict made by `encode` describes."""
    if not isinstance(data, dict):
        raise DecodeError(f"expected an object, got {type(data).__name__}")
    fields = dict(data)
    name = fields.pop(TAG, None)
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise DecodeError(f"unknown event type {name!r}")
    try:
        return converter.structure(fields, cls)
    except Exception as exc:  # cattrs raises ClassValidationError groups and plain errors
        raise DecodeError(f"bad {name}: {'; '.join(_messages(exc))}") from exc


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
        return cattrs.transform_error(exc)
    return [str(exc)]
