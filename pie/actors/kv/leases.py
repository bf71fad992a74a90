"""The fast path's rule: which placed passes earn their context a lease, and what it holds."""

from __future__ import annotations

from pie.actors.kv.context import Chain
from pie.events import kv as ev
from pie.events.sampling import SAMPLERS
from pie.events.speculation import Lease


def lease_for(event: ev.SubmitForward, chain: Chain, number: int, page_size: int) -> Lease | None:
    """Lease `number` on the context when the pass (already placed in `chain`) ends in a plain
    token sampler and the context has room for at least one more token in pages it holds or has
    reserved; None otherwise. Its pages are the context's, then its reserve."""
    slots = event.slots
    if (
        len(slots) != 1
        or slots[0].index != len(event.tokens) - 1
        or not isinstance(slots[0].op, SAMPLERS)
        or event.attention_masks is not None
        or event.logit_mask is not None
        or event.logit_bias
        or event.penalty is not None
        or len(chain.tokens) >= (len(chain.pages) + len(chain.reserved)) * page_size
    ):
        return None
    return Lease(
        lease=number,
        context=event.context,
        requester=event.requester,
        pages=tuple(chain.pages + chain.reserved),
        owned=len(chain.pages),
        masked_pages=tuple(sorted(chain.masked)),
        next_slot=len(chain.tokens),
        next_position=chain.positions[-1] + 1,
        op=slots[0].op,
    )
