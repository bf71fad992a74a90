"""Frames <-> protocol messages. No I/O: the server and the client wrap this.

A frame that cannot be read becomes a `FrameError` that carries the request's `corr` when the
frame had a readable one, so the reply can still name the request it refuses.
"""

from __future__ import annotations

import json
from typing import Any

from cattrs.gen import make_dict_unstructure_fn, override

from pie.events import codec
from pie.wire.messages import CLIENT_MESSAGES, SERVER_MESSAGES, Launch, StreamedEvent, Welcome

codec.register_tagged_union(StreamedEvent)


def _omit_when_default(cls: type, *names: str) -> None:
    """Fields a cluster added are left out of a frame while they hold their default, so a
    frame of a node on its own reads as before."""
    omitted: dict[str, Any] = {name: override(omit_if_default=True) for name in names}
    codec.converter.register_unstructure_hook(
        cls, make_dict_unstructure_fn(cls, codec.converter, **omitted)
    )


_omit_when_default(Launch, "snapshots", "placed")
_omit_when_default(Welcome, "node")

_CLIENT = codec.by_name(CLIENT_MESSAGES)
_SERVER = codec.by_name(SERVER_MESSAGES)

DEFAULT_MAX_FRAME = 16 * 1024 * 1024


class FrameError(ValueError):
    """A frame that is not a well-formed message; `kind` is `bad-frame` or `too-large`."""

    def __init__(self, kind: str, message: str, corr: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.corr = corr


def encode_frame(message: Any) -> str:
    return json.dumps(codec.encode(message), separators=(",", ":"))


def decode_client_frame(frame: str | bytes, max_size: int = DEFAULT_MAX_FRAME) -> Any:
    """The client message in `frame`; raises FrameError saying what is wrong with it."""
    return _decode(frame, _CLIENT, max_size)


def decode_server_frame(frame: str | bytes, max_size: int = DEFAULT_MAX_FRAME) -> Any:
    return _decode(frame, _SERVER, max_size)


def _decode(frame: str | bytes, classes: dict[str, type], max_size: int) -> Any:
    if len(frame) > max_size:
        raise FrameError("too-large", f"frame of {len(frame)} bytes is over {max_size}")
    try:
        data = json.loads(frame)
    except (ValueError, RecursionError) as exc:  # also nested too deep or a number too long
        raise FrameError("bad-frame", f"not JSON: {exc}") from None
    corr = data.get("corr", 0) if isinstance(data, dict) else 0
    corr = corr if type(corr) is int else 0
    try:
        return codec.decode(data, classes, what="message")
    except codec.DecodeError as exc:
        raise FrameError("bad-frame", str(exc), corr) from None
