"""One assistant turn on a context that lives across turns: an optional forced prefill, greedy
generation up to a stop string, the turn closed and written, and counts showing that only new
tokens were fed; optionally compared with a fresh context prefilled with the whole transcript."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from inferlet import Context, Model


@dataclass
class Turn:
    text: str
    """The assistant's text: the prefill, then what was generated, up to and with the stop."""
    stop_reason: str
    """"prefill" when the prefill held a whole action, else the generation's stop reason."""
    reused: int
    """Tokens already in the context when the turn began; no pass of the turn feeds them."""
    filled: int
    """Tokens the turn's first pass fed: what was appended since the last turn, and the prefill."""
    generated: int
    closed: int
    """Tokens written after generating, to close the turn as the chat template does."""
    context: int
    """Tokens in the context when the turn ended."""
    fresh_match: bool | None
    """Whether a fresh context prefilled with the whole transcript generates the same tokens
    (None when not checked)."""

    def report(self) -> dict[str, Any]:
        return asdict(self)


async def take_turn(
    ctx: Context,
    *,
    stop: str,
    max_tokens: int,
    prefill: str = "",
    prefill_acts: bool = False,
    check_fresh: bool = False,
) -> Turn:
    """Runs the assistant's turn after a cue. With `prefill_acts`, the prefill is the whole turn
    and nothing is generated."""
    reused = ctx.info().tokens
    history = ctx.tokens if check_fresh and reused else None
    feed = ctx.fill(prefill).take_pending()
    ctx.fill_tokens(feed)
    if prefill_acts:
        # No generation ends this turn, so the chat state is told here where it ends.
        ctx.fill(ctx.chat.finish_turn(prefill) or "")
        text, reason, generated = prefill, "prefill", []
    else:
        text, reason, generated = await generate(ctx, prefill, stop, max_tokens)
    # The closing is written now, so the next turn's first pass feeds only what is appended.
    await ctx.flush()
    context = ctx.info().tokens
    match = None
    if history is not None and not prefill_acts:
        again = await fresh_generation(ctx.model, history + feed, stop, max_tokens)
        match = again == (generated, reason)
    closed = context - reused - len(feed) - len(generated)
    return Turn(text, reason, reused, len(feed), len(generated), closed, context, match)


async def generate(
    ctx: Context, prefill: str, stop: str, max_tokens: int
) -> tuple[str, str, list[int]]:
    """The turn's text (with the stop string that ended it), stop reason and generated tokens.
    The chat state records only the generated text as the assistant's message; a template that
    renders earlier turns unchanged, such as ChatML, still adds exactly the next turn after it."""
    generation = ctx.generate(max_tokens=max_tokens, stop_strings=[stop])
    tokens = await generation.collect_tokens()
    reason = generation.stop_reason or "length"
    text = prefill + generation.text + (stop if reason == "stop_string" else "")
    return text, reason, tokens


async def fresh_generation(
    model: Model, transcript: list[int], stop: str, max_tokens: int
) -> tuple[list[int], str]:
    """What a new context holding `transcript`, prefilled in one go, generates."""
    with Context(model) as fresh:
        generation = fresh.fill_tokens(transcript).generate(
            max_tokens=max_tokens, stop_strings=[stop]
        )
        tokens = await generation.collect_tokens()
        return tokens, generation.stop_reason or "length"
