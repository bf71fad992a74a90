"""What can go wrong talking to a pie server: the exceptions the client raises."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn


class PieError(Exception):
    """Anything the pie client raises on purpose."""


class CannotConnect(PieError):
    """The WebSocket could not be opened, or closed before the server said `Welcome`."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach {url}: {reason}")
        self.url = url
        self.reason = reason


class ConnectionLost(PieError):
    """The connection closed while a request or an event stream still needed it."""


class EventsOverflowed(PieError):
    """An inferlet's events piled up unread, so the client detached from it."""

    def __init__(self, instance: str, last_seq: int) -> None:
        super().__init__(
            f"events of {instance} were not read in time and the client detached; "
            f"attach again with after={last_seq}"
        )
        self.instance = instance
        self.last_seq = last_seq


class WatchOverflowed(PieError):
    """A watched topic's messages piled up unread, so the client stopped watching it."""

    def __init__(self, topic: str, buffered: int) -> None:
        super().__init__(
            f"messages on {topic!r} were not read in time ({buffered} queued), so the client "
            "stopped watching it"
        )
        self.topic = topic


class MessageTooLarge(PieError):
    """A file too large for one message: its frame would be over the frame limit, which the
    server refuses (`[server] max_frame_mb`; the client's `connect(max_frame=)`)."""

    def __init__(self, path: Path, size: int, max_frame: int) -> None:
        super().__init__(
            f"{path} is {size} bytes; sent as one message (base64 in a frame) it would be over "
            f"the {max_frame}-byte frame limit, so nothing was sent"
        )
        self.size = size
        self.max_frame = max_frame


class ServerError(PieError):
    """The server answered `Failure`; `kind` is a stable word listed in docs/protocol.md."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class NoSuchProgram(ServerError):
    pass


class NoSuchInferlet(ServerError):
    pass


class NotOwner(ServerError):
    pass


class AuthenticationFailed(ServerError):
    pass


_ERRORS: dict[str, type[ServerError]] = {
    "no-such-program": NoSuchProgram,
    "no-such-inferlet": NoSuchInferlet,
    "not-owner": NotOwner,
    "unauthenticated": AuthenticationFailed,
}


def server_error(kind: str, message: str) -> ServerError:
    return _ERRORS.get(kind, ServerError)(kind, message)


def raise_sole(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raises the one exception a nursery wrapped (the client's reader task never raises), so
    callers can catch `ServerError` and friends plainly; several stay grouped."""
    exc = group.exceptions[0] if len(group.exceptions) == 1 else group
    # Raising inside `except` would make the group the exception's context, hiding its own.
    context = exc.__context__
    try:
        raise exc
    finally:
        exc.__context__ = context
