"""The fast path's rule: which placed passes earn their context a lease, and what it holds."""

from __future__ import annotations

from pie.actors.kv.context import Chain
from pie.actors.kv.window import Compactor
from pie.events import kv as ev
from pie.events.sampling import SAMPLERS
from pie.events.speculation import Lease


def lease_for(
    event: ev.SubmitForward, chain: Chain, number: int, page_size: int, *, reserve: bool = True
) -> Lease | None:
    """Lease `number` on the context when the pass (already placed in `chain`) ends in a plain
    token sampler and the context has room for at least one more token in pages it holds (or,
    with `reserve`, has reserved); None otherwise. Its pages are the context's held ones, then
    its reserve: without it, the lease ends where the tail page does, so that the pass after
    goes through the kv actor (an attention window releases pages there)."""
    slots = event.slots
    extra = chain.reserved if reserve else []
    if (
        len(slots) != 1
        or slots[0].index != len(event.tokens) - 1
        or not isinstance(slots[0].op, SAMPLERS)
        or event.attention_masks is not None
        or event.logit_mask is not None
        or event.logit_bias
        or event.penalty is not None
        or len(chain.tokens) >= (len(chain.pages) + len(extra)) * page_size
    ):
        return None
    held = chain.held()
    compact = Compactor(chain.released(), page_size)
    return Lease(
        lease=number,
        context=event.context,
        requester=event.requester,
        pages=tuple(held + extra),
        owned=len(held),
        masked_pages=compact.masked(sorted(chain.masked)),
        next_slot=len(chain.tokens) - compact.shift,
        next_position=chain.next_position(),
        op=slots[0].op,
        adapter=event.adapter,
    )
