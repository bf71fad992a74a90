"""Search over forked contexts: score a continuation exactly (`token_logprobs`), best-of-n
(branches forked off one prefilled prompt, ranked by mean log-probability) and beam search (the
distribution probe at each beam's last token). Forks share the prompt's KV pages, and branches
that wait together are batched into the same forward passes."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from wit_world.imports import forward as fw

from inferlet.context import Context
from inferlet.forward import run_pass
from inferlet.sampling import Distribution, Probe, Sampler, SlotResult, slot_result


async def token_logprobs(prefix: Context, tokens: list[int]) -> list[float]:
    """The log-probability of each of `tokens` following what `prefix` holds, from one pass on
    a fork of it (the fork shares its pages and is destroyed afterwards)."""
    return [score.logprob for score in await score_tokens(prefix, tokens)]


@dataclass
class TokenScore:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """The likeliest tokens at this position and their log-probabilities, likeliest first."""


async def score_tokens(prefix: Context, tokens: list[int], top: int = 0) -> list[TokenScore]:
    """Like `token_logprobs`, with the `top` likeliest alternatives at every position (a
    distribution probe beside each logprob probe, in the same pass)."""
    if not tokens:
        return []
    probe = prefix.fork()
    try:
        feed = probe.feed_for_generation()
        start = len(feed) - 1
        slots = []
        for i, token in enumerate(tokens):
            slots.append(fw.Slot(start + i, Probe.logprobs([token]).slot_op()))
            if top:
                slots.append(fw.Slot(start + i, Probe.distribution(top).slot_op()))
        pass_ = fw.ForwardPass(
            probe.handle,
            feed + tokens[:-1],
            None,
            None,
            None,
            slots,
            [],
            None,
            None,
            probe.adapter,
            [],
        )
        outputs = [slot_result(out) for out in await run_pass(pass_)]
    finally:
        probe.destroy()
    step = 2 if top else 1
    return [token_score(t, outputs[i * step : (i + 1) * step]) for i, t in enumerate(tokens)]


def token_score(token: int, probes: list[SlotResult]) -> TokenScore:
    """A token's score from its probes' results: a `logprobs` probe of the token, then, when
    alternatives were asked for, a `distribution` probe at the same position."""
    logprob = probes[0]
    assert isinstance(logprob, list)
    alternatives: list[tuple[int, float]] = []
    if len(probes) > 1:
        dist = probes[1]
        assert isinstance(dist, Distribution)
        alternatives = [
            (t, math.log(p) if p > 0 else -math.inf)
            for t, p in zip(dist.tokens, dist.probs, strict=True)
        ]
    return TokenScore(token, float(logprob[0]), alternatives)


@dataclass
class Candidate:
    tokens: list[int]
    text: str
    stop_reason: str
    mean_logprob: float
    index: int
    """Which branch it was (branch i draws with seed `seed + i`)."""


async def best_of_n(
    ctx: Context,
    n: int,
    sampler: Sampler,
    *,
    max_tokens: int = 128,
    stop_tokens: Iterable[int] | None = None,
) -> list[Candidate]:
    """Prefills `ctx`'s queued input once, generates `n` branches off it at once and ranks them
    by the mean log-probability of their tokens, best first. `ctx` keeps the prompt."""
    await ctx.flush()
    branches = [ctx.fork() for _ in range(n)]
    try:
        generations = [
            branch.generate(
                _branch_sampler(sampler, i), max_tokens=max_tokens, stop_tokens=stop_tokens
            )
            for i, branch in enumerate(branches)
        ]
        await asyncio.gather(*(g.collect_tokens() for g in generations))
        scores = await asyncio.gather(*(token_logprobs(ctx, g.tokens) for g in generations))
    finally:
        for branch in branches:
            branch.destroy()
    candidates = [
        Candidate(g.tokens, g.text, g.stop_reason or "", _mean(s), i)
        for i, (g, s) in enumerate(zip(generations, scores, strict=True))
    ]
    return sorted(candidates, key=lambda c: (-c.mean_logprob, c.index))


def _branch_sampler(sampler: Sampler, i: int) -> Sampler:
    if sampler.seed is None:
        return sampler
    return Sampler(sampler.kind, sampler.temperature, sampler.k, sampler.p, sampler.seed + i)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    """The sum of the tokens' log-probabilities."""
    finished: str = ""
    """"stop_token" or "length" once the beam has ended."""
    text: str = ""
    ctx: Context | None = None
    feed: list[int] = field(default_factory=list)

    def score(self, length_penalty: float) -> float:
        return self.logprob / max(1, len(self.tokens)) ** length_penalty


async def beam_search(
    ctx: Context,
    width: int,
    *,
    max_tokens: int = 64,
    stop_tokens: Iterable[int] | None = None,
    length_penalty: float = 1.0,
) -> list[Beam]:
    """The `width` most likely continuations found keeping `width` beams per step, best first
    by `logprob / len(tokens) ** length_penalty`. Every step runs one pass per live beam, all
    batched, with a distribution probe of the `width` likeliest next tokens; a chosen
    continuation forks its parent (sharing its pages). Width 1 is greedy decoding. `ctx` keeps
    the prompt; the beams' contexts are released."""
    if width < 1 or max_tokens < 1:
        raise ValueError("width and max_tokens must be at least 1")
    stops = frozenset(ctx.model.stop_tokens if stop_tokens is None else stop_tokens)
    await ctx.flush()
    root = ctx.fork()
    live = [Beam(ctx=root, feed=root.feed_for_generation())]
    done: list[Beam] = []
    try:
        while live and len(done) < width:
            live = await _step(live, width, stops, done)
            for beam in [b for b in live if len(b.tokens) >= max_tokens]:
                beam.finished = "length"
                done.append(beam)
            live = [b for b in live if not b.finished]
    finally:
        for beam in live + done:
            if beam.ctx is not None:
                beam.ctx.destroy()
    for beam in done:
        beam.text, beam.ctx = ctx.model.decode(beam.tokens), None
    return sorted(done, key=lambda b: -b.score(length_penalty))[:width]


async def _step(
    live: list[Beam], width: int, stops: frozenset[int], done: list[Beam]
) -> list[Beam]:
    probe = Probe.distribution(width).slot_op()
    dists = await asyncio.gather(*(_distribution(beam, probe) for beam in live))
    options = [
        (beam.logprob + math.log(p), i, token)
        for i, (beam, dist) in enumerate(zip(live, dists, strict=True))
        for token, p in zip(dist.tokens, dist.probs, strict=True)
        if p > 0
    ]
    chosen = sorted(options, key=lambda o: (-o[0], o[1], o[2]))[:width]
    used: set[int] = set()
    following: list[Beam] = []
    for logprob, i, token in chosen:
        parent = live[i]
        if token in stops:
            done.append(Beam(list(parent.tokens), logprob, "stop_token"))
            continue
        assert parent.ctx is not None
        child_ctx = parent.ctx if i not in used else parent.ctx.fork()
        used.add(i)
        following.append(Beam(parent.tokens + [token], logprob, ctx=child_ctx, feed=[token]))
    for i, parent in enumerate(live):
        if i not in used and parent.ctx is not None:
            parent.ctx.destroy()
    return following


async def _distribution(beam: Beam, probe: fw.SlotOp) -> Distribution:
    assert beam.ctx is not None
    slot = fw.Slot(len(beam.feed) - 1, probe)
    (out,) = await run_pass(
        fw.ForwardPass(
            beam.ctx.handle,
            beam.feed,
            None,
            None,
            None,
            [slot],
            [],
            None,
            None,
            beam.ctx.adapter,
            [],
        )
    )
    result = slot_result(out)
    assert isinstance(result, Distribution)
    return result
