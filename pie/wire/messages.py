"""The wire protocol's vocabulary: what a client may send and what the server answers.

Each message is one WebSocket text frame holding one JSON object, encoded by the one cattrs
converter (`pie.events.codec`) and tagged with its class name under "type". See
docs/protocol.md.
"""

from __future__ import annotations

from typing import TypeAlias

from attrs import frozen

from pie.events import inferlet as ev

PROTOCOL_VERSION = 1

# -- client -> server: every request carries a `corr` chosen by the client ---------------------


@frozen(kw_only=True)
class Authenticate:
    """Token authentication, or the answer to a challenge (`signature`, base64)."""

    corr: int
    user: str
    token: str | None = None
    signature: str | None = None


@frozen(kw_only=True)
class RequestChallenge:
    """Asks for a nonce to sign with the user's private key."""

    corr: int
    user: str


@frozen(kw_only=True)
class QueryProgram:
    """Is a program (content hash, name or name@version) installed?"""

    corr: int
    program: str


@frozen(kw_only=True)
class UploadProgram:
    """One chunk of a program upload; chunks of one upload share `hash` and arrive in order."""

    corr: int
    name: str
    version: str
    hash: str
    size: int
    index: int
    count: int
    data: bytes


@frozen(kw_only=True)
class Launch:
    """On a clustered node the launch may be answered with `Redirect` to another node: to the
    one holding the named `snapshots`, else to the least-loaded one. `placed` says the client
    was redirected already, so it runs where it arrives."""

    corr: int
    program: str
    input: str = ""
    snapshots: tuple[str, ...] = ()
    placed: bool = False


@frozen(kw_only=True)
class Attach:
    """Stream an inferlet's events to this connection, replaying those after `after`."""

    corr: int
    instance: str
    after: int = 0


@frozen(kw_only=True)
class Detach:
    corr: int
    instance: str


@frozen(kw_only=True)
class SendMessage:
    """Text or bytes for the inferlet's `session.receive`."""

    corr: int
    instance: str
    text: str | None = None
    data: bytes | None = None


@frozen(kw_only=True)
class Terminate:
    corr: int
    instance: str


@frozen(kw_only=True)
class ListInferlets:
    corr: int


@frozen(kw_only=True)
class QueryStatistics:
    corr: int


@frozen(kw_only=True)
class Watch:
    """Stream every message broadcast on `topic` from now on to this connection."""

    corr: int
    topic: str


@frozen(kw_only=True)
class Unwatch:
    corr: int
    topic: str


@frozen(kw_only=True)
class Publish:
    """Broadcast `message` on `topic`, as an inferlet's `messaging.broadcast` does."""

    corr: int
    topic: str
    message: str


@frozen(kw_only=True)
class Push:
    """Append `message` to `queue`, as an inferlet's `messaging.push` does."""

    corr: int
    queue: str
    message: str


ClientMessage: TypeAlias = (
    Authenticate
    | RequestChallenge
    | QueryProgram
    | UploadProgram
    | Launch
    | Attach
    | Detach
    | SendMessage
    | Terminate
    | ListInferlets
    | QueryStatistics
    | Watch
    | Unwatch
    | Publish
    | Push
)

# -- server -> client ----------------------------------------------------------------------------


@frozen(kw_only=True)
class ModelCard:
    """A served model: its name, what it reads (text, image, video, audio) and what it
    produces (text, speech)."""

    name: str
    inputs: tuple[str, ...] = ("text",)
    outputs: tuple[str, ...] = ("text",)


@frozen(kw_only=True)
class Welcome:
    """The first frame on every connection."""

    protocol: int
    server: str
    model: str
    """The default model's name."""
    auth_required: bool
    models: tuple[ModelCard, ...] = ()
    """Every served model, the default first (empty from a server that does not say)."""
    node: str = ""
    """This node's id in its cluster; empty from a node on its own."""


@frozen(kw_only=True)
class Done:
    """A request with nothing else to say succeeded."""

    corr: int


@frozen(kw_only=True)
class Failure:
    """A request failed. `kind` is a stable word (docs/protocol.md lists them); `message`,
    for people, names the bad field when the frame itself was wrong."""

    corr: int
    kind: str
    message: str


@frozen(kw_only=True)
class ChallengeIssued:
    corr: int
    nonce: str


@frozen(kw_only=True)
class Authenticated:
    corr: int
    user: str


@frozen(kw_only=True)
class ProgramFound:
    corr: int
    hash: str
    name: str
    version: str
    size: int


@frozen(kw_only=True)
class UploadProgress:
    corr: int
    received: int
    """Bytes received so far of this upload."""


@frozen(kw_only=True)
class Launched:
    corr: int
    instance: str
    queued: bool


@frozen(kw_only=True)
class Redirect:
    """The answer to a `Launch` placed on another node of the cluster, or to a request about an
    inferlet that runs on another node: send it there (a `Launch` with `placed` set)."""

    corr: int
    node: str
    url: str
    """The node's WebSocket URL."""


@frozen(kw_only=True)
class InferletSummary:
    instance: str
    program: str
    user: str
    state: str
    """queued, running or stopping."""
    attached: bool


@frozen(kw_only=True)
class InferletList:
    corr: int
    inferlets: tuple[InferletSummary, ...]


@frozen(kw_only=True)
class EngineStatus:
    corr: int
    model: str
    pages_total: int
    pages_free: int
    contexts: int
    passes: int
    mean_batch_size: float
    last_pass_ms: float
    inferlets_running: int
    inferlets_queued: int
    pages_cached: int = 0
    """Free pages still holding reusable prompt pages (counted in pages_free too)."""
    prefix_hit_tokens: int = 0
    """Prompt tokens whose KV was reused from the prefix cache instead of computed."""
    driver_threads: int = 0
    """The CPU threads the driver computes with; 0 from a server that does not say."""
    adapters: tuple[str, ...] = ()
    """The LoRA adapters loaded with the model, by name."""
    memory_resident_mb: float = 0.0
    """The engine process's resident memory, and its parts below (pie.drivers.memory)."""
    memory_model_mb: float = 0.0
    memory_kv_used_mb: float = 0.0
    memory_kv_pool_mb: float = 0.0
    memory_other_mb: float = 0.0
    models: tuple[ModelLoad, ...] = ()
    """Each served model's pages and passes, the default first (its figures are also the
    flat ones above)."""


@frozen(kw_only=True)
class ModelLoad:
    """One served model in a status reply."""

    card: ModelCard
    pages_total: int
    pages_free: int
    contexts: int
    passes: int


StreamedEvent: TypeAlias = (
    ev.InferletStarted
    | ev.InferletOutput
    | ev.SessionMessage
    | ev.InferletReturned
    | ev.InferletFailed
    | ev.InferletTerminated
)


@frozen(kw_only=True)
class InferletEvent:
    """Something an attached inferlet did; `seq` counts from 1 per inferlet, so a client that
    re-attaches with `after=seq` gets exactly what it missed (while it is still buffered)."""

    instance: str
    seq: int
    event: StreamedEvent


@frozen(kw_only=True)
class WatchedMessage:
    """A message broadcast on a topic this connection watches; `sender` is the bus address
    that broadcast it (`inferlet:ID` for an inferlet, `session:N` for a client)."""

    topic: str
    sender: str
    message: str


ServerMessage: TypeAlias = (
    Welcome
    | Done
    | Failure
    | ChallengeIssued
    | Authenticated
    | ProgramFound
    | UploadProgress
    | Launched
    | Redirect
    | InferletList
    | EngineStatus
    | InferletEvent
    | WatchedMessage
)

CLIENT_MESSAGES: tuple[type, ...] = ClientMessage.__args__
SERVER_MESSAGES: tuple[type, ...] = ServerMessage.__args__
