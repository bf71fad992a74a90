"""Commands to the inferlet actor and the lifecycle of an inferlet instance.

Lifecycle events go to the address that launched the instance: `InferletStarted`, then any
number of `InferletOutput` / `SessionMessage` (and, for an HTTP-served instance, one
`ResponseStarted` and its `ResponseBody` pieces), then exactly one of `InferletReturned`,
`InferletFailed` or `InferletTerminated`.
"""

from __future__ import annotations

from attrs import frozen


@frozen(kw_only=True)
class IncomingRequest:
    """An HTTP request for an HTTP-served inferlet; `path` is below its mount prefix."""

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


@frozen(kw_only=True)
class ProgramRegistered:
    """A program was bound to a name (a log record, not a delivery's payload): the inferlet
    core resolves launches against these, so replay rebinds them in the same order."""

    hash: str
    name: str
    version: str
    owner: str | None
    size: int


@frozen(kw_only=True)
class LaunchInferlet:
    """Run `program` (a name, name@version or content hash) with `input`, or, given `request`,
    call its `handle` export with that request.

    Replied to with `InferletLaunched` at once; the instance waits in the admission queue
    while `max_concurrent` instances run.
    """

    corr: int
    requester: str
    program: str
    input: str
    user: str = "local"
    request: IncomingRequest | None = None


@frozen(kw_only=True)
class InferletLaunched:
    corr: int
    instance: str
    queued: bool = False
    """True when the instance waits for a free slot before it starts."""


@frozen(kw_only=True)
class DetachInferlet:
    """Let a child launched by `requester` outlive it (it is no longer stopped with it)."""

    corr: int
    requester: str
    instance: str


@frozen(kw_only=True)
class TerminateInferlet:
    """Stop a running or queued instance launched by `requester` (or by its user)."""

    corr: int
    requester: str
    instance: str


def check_one_payload(text: str | None, data: bytes | None) -> None:
    """A session message is text or bytes: exactly one of the two."""
    if (text is None) == (data is None):
        raise ValueError("give exactly one of text, data")


@frozen(kw_only=True)
class SendToInferlet:
    """A message from the launching client for the instance's `session.receive`."""

    corr: int
    requester: str
    instance: str
    text: str | None = None
    data: bytes | None = None

    def __attrs_post_init__(self) -> None:
        check_one_payload(self.text, self.data)


@frozen(kw_only=True)
class SessionInput:
    """A client message delivered to the instance (from the inferlet actor)."""

    instance: str
    text: str | None = None
    data: bytes | None = None


@frozen(kw_only=True)
class SessionReceived:
    """The instance's program took a session message of `size` bytes (from the instance to the
    inferlet actor, which counts what each instance holds unread)."""

    instance: str
    size: int


def session_size(text: str | None, data: bytes | None) -> int:
    """What a session message counts against its inferlet's and its user's bounds: its bytes,
    or its text's UTF-8 bytes."""
    if data is not None:
        return len(data)
    return len(text.encode("utf-8", "surrogatepass")) if text else 0


@frozen(kw_only=True)
class InferletStarted:
    instance: str
    program: str


@frozen(kw_only=True)
class InferletOutput:
    """A chunk the guest wrote to its stdout or stderr."""

    instance: str
    stream: str
    text: str


@frozen(kw_only=True)
class SessionMessage:
    """What the guest sent with `session.send`: text or bytes."""

    instance: str
    text: str | None = None
    data: bytes | None = None


@frozen(kw_only=True)
class ResponseStarted:
    """An HTTP-served instance's status and headers."""

    instance: str
    status: int
    headers: tuple[tuple[str, str], ...]


@frozen(kw_only=True)
class ResponseBody:
    """The next piece of an HTTP-served instance's response body."""

    instance: str
    chunk: bytes


@frozen(kw_only=True)
class InferletReturned:
    instance: str
    result: str
    seconds: float


@frozen(kw_only=True)
class InferletFailed:
    """The guest returned an error, trapped, ran out of its budget or its memory cap, or took a
    directory over its quota.

    `status` is one of failed, trapped, timeout, memory, quota.
    """

    instance: str
    status: str
    error: str
    seconds: float


@frozen(kw_only=True)
class InferletTerminated:
    """Stopped by `TerminateInferlet`, by its parent ending, or by the engine shutting down."""

    instance: str
    reason: str
    seconds: float


@frozen(kw_only=True)
class InferletFinished:
    """The inferlet actor's own record that an instance's thread has ended (its outcome)."""

    instance: str
    status: str
    result: str | None = None
    error: str | None = None
    seconds: float = 0.0


InferletEnd = InferletReturned | InferletFailed | InferletTerminated


@frozen(kw_only=True)
class InferletOutcome:
    """How an inferlet ended: `status` is returned, failed, trapped, timeout, memory, quota or
    terminated; `result` is set when it returned, `error` otherwise."""

    instance: str
    status: str
    result: str | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "returned"


def outcome_of(end: InferletEnd) -> InferletOutcome:
    match end:
        case InferletReturned():
            return InferletOutcome(
                instance=end.instance, status="returned", result=end.result, seconds=end.seconds
            )
        case InferletFailed():
            return InferletOutcome(
                instance=end.instance, status=end.status, error=end.error, seconds=end.seconds
            )
    return InferletOutcome(
        instance=end.instance, status="terminated", error=end.reason, seconds=end.seconds
    )
