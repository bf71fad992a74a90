"""Commands to the kv actor and the facts it answers with."""

from __future__ import annotations

from attrs import field, frozen

from pie.events.forward import MediaRun
from pie.events.sampling import LogitBias, Penalty, Rle, SamplingSlot


@frozen(kw_only=True)
class CreateContext:
    corr: int
    requester: str
    user: str = "local"
    """Whose context it is: under the "user" prefix cache scope, only contexts of the same user
    reuse each other's pages."""


@frozen(kw_only=True)
class ForkContext:
    corr: int
    requester: str
    context: int


@frozen(kw_only=True)
class DestroyContext:
    corr: int
    requester: str
    context: int


@frozen(kw_only=True)
class SaveContext:
    """Snapshot a context under a name (per user) that outlives its requester."""

    corr: int
    requester: str
    context: int
    name: str
    user: str = "local"


@frozen(kw_only=True)
class OpenContext:
    """A new context forked from a snapshot; `take` also removes the snapshot."""

    corr: int
    requester: str
    name: str
    user: str = "local"
    take: bool = False


@frozen(kw_only=True)
class DeleteSnapshot:
    corr: int
    requester: str
    name: str
    user: str = "local"


@frozen(kw_only=True)
class DropSnapshots:
    """Delete every snapshot of `user`: the operator's way to free what a user saved."""

    corr: int
    requester: str
    user: str


@frozen(kw_only=True)
class TruncateContext:
    """Drop the last `count` tokens (and their pages once empty)."""

    corr: int
    requester: str
    context: int
    count: int


@frozen(kw_only=True)
class ReserveTokens:
    """Make sure `count` more tokens fit in a context without allocating: the pages they need
    are taken from the pool now and kept aside for the context's later passes."""

    corr: int
    requester: str
    context: int
    count: int


@frozen(kw_only=True)
class MaskPages:
    """Hide (or show again) whole pages of a context from attention: windows and sinks."""

    corr: int
    requester: str
    context: int
    pages: tuple[int, ...]
    masked: bool = True


@frozen(kw_only=True)
class ReleasePages:
    """Free whole pages of a context that no later token attends to (windows and sinks): they
    are masked for good and their KV goes back to the pool. Only full, written pages may go."""

    corr: int
    requester: str
    context: int
    pages: tuple[int, ...]


@frozen(kw_only=True)
class AttentionWindow:
    """Attention sinks plus a sliding window, in pages: before a pass is placed, every full page
    after the first `sink_pages` that is not among the last `window_pages` (the page the pass
    starts writing in counts as one) is released."""

    sink_pages: int = 1
    window_pages: int = 8


@frozen(kw_only=True)
class DescribeContext:
    corr: int
    requester: str
    context: int


@frozen(kw_only=True)
class SubmitForward:
    """Append `tokens` to a context and run them through the model in one pass."""

    corr: int
    requester: str
    context: int
    tokens: tuple[int, ...]
    positions: tuple[int, ...] | None = None
    """None continues from the context's last position."""
    attention_masks: tuple[Rle, ...] | None = None
    logit_mask: Rle | None = None
    logit_bias: tuple[LogitBias, ...] = ()
    penalty: Penalty | None = None
    slots: tuple[SamplingSlot, ...] = ()
    fast: bool = False
    """The requester can take the context's next plain decodes on the fast path (a lease)."""
    window: AttentionWindow | None = None
    """Release the pages that leave the window before placing the pass."""
    adapter: str | None = None
    """The LoRA adapter (by name) the tokens run through; None: the base model. KV computed
    under one adapter is never reused for another or for the base model."""
    media: tuple[MediaRun, ...] = ()
    """Soft tokens among `tokens` (media encoder output in place of their embedding), in
    order and apart; KV computed from media is reused only for the same media."""


@frozen(kw_only=True)
class ReleaseRequester:
    """The requester is gone: destroy every context it still owns."""

    corr: int
    requester: str
    reply: bool = True
    """False when nobody is left to answer (an inferlet that ended)."""


@frozen(kw_only=True)
class PassApplied:
    """The inference actor wrote a request's tokens: commit them (or roll them back)."""

    corr: int
    context: int
    ok: bool = True


@frozen(kw_only=True)
class LendSnapshot:
    """Pin a snapshot's pages while its KV is read out (to copy it to another node); the reply
    is a `SnapshotLent`, and a `LeaseReleased` of its lease unpins them."""

    corr: int
    requester: str
    name: str
    user: str


@frozen(kw_only=True)
class ImportPages:
    """Place `tokens` in a context as a pass would, for KV that arrives from elsewhere instead
    of from the model: the reply is a `PagesPlaced`; a `PassApplied` of its corr commits the
    pages once their KV is written (or rolls them back)."""

    corr: int
    requester: str
    context: int
    tokens: tuple[int, ...]
    positions: tuple[int, ...]


KvCommand = (
    CreateContext
    | ForkContext
    | DestroyContext
    | SaveContext
    | OpenContext
    | DeleteSnapshot
    | DropSnapshots
    | TruncateContext
    | ReserveTokens
    | MaskPages
    | ReleasePages
    | DescribeContext
    | SubmitForward
    | ReleaseRequester
    | PassApplied
    | LendSnapshot
    | ImportPages
)


@frozen(kw_only=True)
class ContextCreated:
    corr: int
    context: int


@frozen(kw_only=True)
class ContextInfo:
    corr: int
    context: int
    tokens: tuple[int, ...]
    positions: tuple[int, ...] = field(default=())
    next_position: int = 0
    """The position the next token written takes."""
    pages: int = 0
    """Pages holding the context's tokens."""
    masked_pages: tuple[int, ...] = ()
    """Page indices hidden from attention, the released ones included."""
    released_pages: tuple[int, ...] = ()
    """Page indices whose KV was freed (see `ReleasePages`)."""
    reserved_pages: int = 0
    """Pages set aside by `ReserveTokens` that no token uses yet."""


@frozen(kw_only=True)
class Done:
    """A command with nothing else to say succeeded."""

    corr: int


@frozen(kw_only=True)
class RequestFailed:
    """Any command failed; `kind` is a stable word for programs, `message` is for people."""

    corr: int
    kind: str
    message: str


@frozen(kw_only=True)
class SnapshotMissing:
    """To a clustered node's directory of named snapshots: a command on a snapshot this kv core
    lacks, which the directory answers (another node may hold it)."""

    corr: int
    requester: str
    name: str
    user: str
    take: bool = False
    delete: bool = False
    message: str
    """The answer when no node holds it (what the core would have answered alone)."""


@frozen(kw_only=True)
class SnapshotLent:
    """A snapshot's tokens and the pool pages holding their KV, pinned under `lease`. `plain`
    is False when its KV also depends on more than its tokens and positions (adapters, custom
    attention masks, media, masked or released pages)."""

    corr: int
    lease: int
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    pages: tuple[int, ...]
    plain: bool


@frozen(kw_only=True)
class PagesPlaced:
    """Where an `ImportPages` put its tokens: the context's pages, and the first token whose
    KV must be written (those before it are committed pages found by the prefix cache)."""

    corr: int
    pages: tuple[int, ...]
    kv_start: int
