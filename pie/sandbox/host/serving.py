"""The `serving` interface: an HTTP-served instance streams its response to the front end that
launched it. `finish` turns what `handle` returned into the response's last events."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance

from pie.events import inferlet as ev
from pie.sandbox.host.state import HostFailure, InstanceState, current, host_call
from pie.sandbox.wasm import add_host_func

INTERFACE = "pie:inferlet/serving@0.1.0"

MAX_CHUNK_BYTES = 16 * 1024 * 1024
MAX_HEADERS = 100


class Response:
    """Where an HTTP-served instance's response stands."""

    def __init__(self) -> None:
        self.started = False


def respond(status: int, headers: Any) -> None:
    state, response = _serving()
    if response.started:
        raise HostFailure("invalid", "the response has already started")
    _start(state, response, status, headers)


def write(chunk: bytes) -> None:
    state, response = _serving()
    if not response.started:
        raise HostFailure("invalid", "call respond before writing the body")
    _post_body(state, bytes(chunk))


def finish(state: InstanceState, returned: Any) -> None:
    """Sends the head (unless `respond` did) and the body `handle` returned."""
    response: Response = state.response
    if not response.started:
        _start(state, response, returned.status, returned.headers)
    _post_body(state, bytes(returned.body))


def _start(state: InstanceState, response: Response, status: int, headers: Any) -> None:
    pairs = check_head(status, headers)
    response.started = True
    head = ev.ResponseStarted(instance=state.instance, status=status, headers=pairs)
    state.bridge.post("inferlets", head)


def check_head(status: int, headers: Any) -> tuple[tuple[str, str], ...]:
    if not is_final_status(status):
        raise HostFailure("invalid", f"status {status} is not a final HTTP status (200-599)")
    if len(headers) > MAX_HEADERS:
        raise HostFailure("invalid", f"{len(headers)} headers are more than {MAX_HEADERS}")
    pairs = tuple((h.name, h.value) for h in headers)
    for name, value in pairs:
        if not _is_token(name) or not _is_field_value(value):
            raise HostFailure("invalid", f"bad response header {name!r}: {value!r}")
    return pairs


def is_final_status(status: int) -> bool:
    """What a program may answer: interim (1xx) statuses belong to the server's own protocol
    (a 101 would switch the connection away from HTTP)."""
    return 200 <= status <= 599


def _post_body(state: InstanceState, chunk: bytes) -> None:
    if len(chunk) > MAX_CHUNK_BYTES:
        raise HostFailure("invalid", f"a body piece of {len(chunk)} bytes is over the limit")
    if chunk:
        state.bridge.post("inferlets", ev.ResponseBody(instance=state.instance, chunk=chunk))


def _serving() -> tuple[InstanceState, Response]:
    state = current()
    if state.response is None:
        raise HostFailure("invalid", "this instance is not serving an HTTP request")
    return state, state.response


_TOKEN_EXTRA = frozenset("!#$%&'*+-.^_`|~")


def _is_token(name: str) -> bool:
    return bool(name) and all(c.isascii() and (c.isalnum() or c in _TOKEN_EXTRA) for c in name)


def _is_field_value(value: str) -> bool:
    return all(c == "\t" or (" " <= c <= "~") or "\x80" <= c <= "\xff" for c in value)


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "respond", host_call(respond))
    add_host_func(instance, "write", host_call(write))
