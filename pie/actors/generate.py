"""Text generation on the engine: prompt formatting and the decode loop, one forward pass
per token through a requester (what `pie generate` and the benchmarks run)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
from attrs import frozen

from pie.actors.requester import Requester, RequestRefused
from pie.events.sampling import Argmax, Multinomial, Sampler, SamplingSlot, TokenOutput, TopP


@frozen(kw_only=True)
class Generation:
    prompt_tokens: int
    tokens: tuple[int, ...]
    stop_reason: str
    """"stop" (a stop token was sampled) or "length" (max_tokens reached)."""
    prefill_seconds: float
    decode_seconds: float


def make_sampler(
    temperature: float, *, top_p: float | None = None, seed: int | None = None
) -> Sampler:
    """Temperature 0 is greedy; otherwise multinomial, or nucleus when top_p is given."""
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if temperature == 0:
        return Argmax()
    if top_p is not None and top_p < 1.0:
        return TopP(temperature=temperature, p=top_p, seed=seed)
    return Multinomial(temperature=temperature, seed=seed)


def step_sampler(sampler: Sampler, step: int) -> Sampler:
    """The sampler for decode step `step`: a seeded sampler gets a distinct, reproducible seed
    per step, so a whole generation repeats exactly without every step drawing the same number."""
    seed = getattr(sampler, "seed", None)
    if seed is None:
        return sampler
    return attrs.evolve(sampler, seed=(seed * 1_000_003 + step) % (2**63))


def prompt_ids(
    tokenizer: Any, prompt: str, *, raw: bool = False, system: str | None = None
) -> list[int]:
    """Token ids for a prompt: chat-templated as one user turn (plus a system turn when given)
    unless `raw`."""
    if raw:
        return list(tokenizer.encode(prompt))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return list(
        tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    )


async def generate(
    requester: Requester,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    sampler: Sampler,
    stop_tokens: Sequence[int] = (),
    context: int | None = None,
    adapter: str | None = None,
) -> Generation:
    """Prefills `prompt` into a fresh context (or `context`), then decodes one token per pass,
    every pass through LoRA `adapter` when one is named.

    Pages for the whole generation are reserved first, so decode steps allocate none. The
    context is destroyed at the end unless it was passed in (it then keeps any unused reserve,
    which its next passes take first).
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    own = context is None
    ctx = await requester.create_context() if context is None else context
    try:
        # The last sampled token is never fed back, so it needs no KV.
        await _reserve(requester, ctx, len(prompt) + max_tokens - 1)
        return await _decode(
            requester, ctx, list(prompt), max_tokens, sampler, set(stop_tokens), adapter
        )
    finally:
        if own:
            await requester.destroy(ctx)


async def _reserve(requester: Requester, ctx: int, count: int) -> None:
    """Reservation only saves allocations: without enough free pages, decoding still runs and
    allocates step by step (and is refused only if a step itself finds no page)."""
    try:
        await requester.reserve(ctx, count)
    except RequestRefused as err:
        if err.kind != "out_of_pages":
            raise


async def _decode(
    requester: Requester,
    ctx: int,
    prompt: list[int],
    max_tokens: int,
    sampler: Sampler,
    stop: set[int],
    adapter: str | None,
) -> Generation:
    started = time.perf_counter()
    feed = prompt
    tokens: list[int] = []
    prefill_done = started
    reason = "length"
    for step in range(max_tokens):
        slot = SamplingSlot(index=len(feed) - 1, op=step_sampler(sampler, step))
        (out,) = await requester.forward(ctx, feed, (slot,), adapter=adapter)
        assert isinstance(out, TokenOutput)
        if step == 0:
            prefill_done = time.perf_counter()
        tokens.append(out.token)
        if out.token in stop:
            reason = "stop"
            break
        feed = [out.token]
    finished = time.perf_counter()
    return Generation(
        prompt_tokens=len(prompt),
        tokens=tuple(tokens),
        stop_reason=reason,
        prefill_seconds=prefill_done - started,
        decode_seconds=finished - prefill_done,
    )
