"""Commands to the messaging bus (queues and topics) and what it delivers."""

from __future__ import annotations

from attrs import frozen


@frozen(kw_only=True)
class Push:
    """Append a message to a named queue; one puller receives it. `user` is charged for the
    message while it waits in the queue (empty: the requester stands for its own user)."""

    corr: int
    requester: str
    queue: str
    message: str
    user: str = ""


@frozen(kw_only=True)
class Pull:
    """Take the oldest message of a queue, waiting for one if the queue is empty."""

    corr: int
    requester: str
    queue: str


@frozen(kw_only=True)
class Publish:
    """Send a message to every current subscriber of a topic."""

    corr: int
    requester: str
    topic: str
    message: str


@frozen(kw_only=True)
class Subscribe:
    corr: int
    requester: str
    topic: str


@frozen(kw_only=True)
class Unsubscribe:
    corr: int
    requester: str
    topic: str


@frozen(kw_only=True)
class LeaveBus:
    """The requester is gone: drop its subscriptions and waiting pulls."""

    corr: int
    requester: str


BusCommand = Push | Pull | Publish | Subscribe | Unsubscribe | LeaveBus


@frozen(kw_only=True)
class Pulled:
    """The answer to a Pull."""

    corr: int
    queue: str
    message: str


@frozen(kw_only=True)
class TopicMessage:
    """A published message delivered to one subscriber (`corr` is its Subscribe's)."""

    corr: int
    topic: str
    sender: str
    message: str


def message_size(message: str) -> int:
    """A message's size in UTF-8, the measure of every bound on messages (ASCII text is
    measured without encoding it)."""
    if message.isascii():
        return len(message)
    return len(message.encode("utf-8", "surrogatepass"))
