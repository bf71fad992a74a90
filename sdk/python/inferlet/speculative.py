"""Speculative decoding inside the program: a drafter proposes the next tokens, one forward pass
feeds them all and samples at every position, and the longest prefix the model agrees with is
kept (plus the model's own next token); the rest is truncated from the context.

A draft token is kept only when the sampler, at that step with that step's seed, chooses it, so
the output is the plain generation's, token for token, whatever the drafter proposes; a good
drafter only makes it take fewer passes. Drafters: `PromptLookup` (n-grams of the text so far)
and `Jacobi` (the model's own guesses from the previous pass).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from wit_world.imports import context as _ctx
from wit_world.imports import forward as fw

from inferlet.context import Context
from inferlet.errors import call
from inferlet.forward import run_pass
from inferlet.sampling import Sampler


class Drafter(Protocol):
    def draft(self, history: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `history` (the prompt and everything generated)."""
        ...

    def observe(self, predictions: list[int], accepted: int) -> None:
        """What the model predicted at each fed position of the last pass (the pending token,
        then each draft token), and how many draft tokens were kept."""
        ...


class PromptLookup:
    """Finds the latest earlier occurrence of the last `ngram` tokens (trying shorter n-grams
    down to `min_ngram`) and proposes the tokens that followed it: strong on text that repeats
    or quotes its input (code edits, extraction, summaries that cite)."""

    def __init__(self, ngram: int = 3, min_ngram: int = 1) -> None:
        self.ngram = ngram
        self.min_ngram = min_ngram

    def draft(self, history: list[int], k: int) -> list[int]:
        for n in range(min(self.ngram, len(history) - 1), self.min_ngram - 1, -1):
            tail = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):
                if history[start : start + n] == tail:
                    return history[start + n : start + n + k]
        return []

    def observe(self, predictions: list[int], accepted: int) -> None:
        pass


class Jacobi:
    """Jacobi decoding: the draft is the model's own predictions, from the last pass, at the
    positions after the kept prefix (each computed from a guess one step behind); they converge
    to the greedy continuation, several tokens per pass where the text is predictable."""

    def __init__(self) -> None:
        self._guess: list[int] = []

    def draft(self, history: list[int], k: int) -> list[int]:
        guess = self._guess[:k]
        while len(guess) < k:
            guess.append(guess[-1] if guess else history[-1])
        return guess

    def observe(self, predictions: list[int], accepted: int) -> None:
        self._guess = predictions[accepted + 1 :]


@dataclass
class Speculation:
    """A speculative generation's result and what it cost."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = ""
    """"stop_token" or "length"."""
    passes: int = 0
    """Forward passes, the prompt's included."""
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        """Share of drafted tokens the model kept."""
        return self.accepted / self.drafted if self.drafted else 0.0


async def speculate(
    ctx: Context,
    drafter: Drafter,
    *,
    sampler: Sampler | None = None,
    max_tokens: int = 256,
    draft_tokens: int = 4,
    stop_tokens: Iterable[int] | None = None,
) -> Speculation:
    """Generates like `ctx.generate(sampler, max_tokens=..., stop_tokens=...)`, token for token,
    feeding up to `draft_tokens` drafted tokens in each pass. Like a generation, it leaves the
    last sampled token queued in the context."""
    if max_tokens < 1 or draft_tokens < 0:
        raise ValueError("max_tokens must be at least 1 and draft_tokens at least 0")
    run = _Speculator(ctx, drafter, sampler or Sampler.argmax(), max_tokens, draft_tokens)
    stops = frozenset(ctx.model.stop_tokens if stop_tokens is None else stop_tokens)
    ctx.acquire()
    try:
        await run.loop(stops)
    except BaseException:
        ctx.release(None)
        raise
    result = run.result
    result.text = ctx.model.decode(result.tokens)
    ctx.release(run.last_written)
    text = result.text if ctx.chat.cued else ""
    ctx.queue_generated(run.final, text, stopped_on_token=result.stop_reason == "stop_token")
    return result


class _Speculator:
    def __init__(
        self, ctx: Context, drafter: Drafter, sampler: Sampler, max_tokens: int, k: int
    ) -> None:
        self.ctx = ctx
        self.drafter = drafter
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.k = k
        self.result = Speculation()
        self.final = 0
        """The last sampled token: never written by a pass."""
        self.last_written: int | None = None

    async def loop(self, stops: frozenset[int]) -> None:
        feed = self.ctx.feed_for_generation()
        history = self.ctx.tokens + feed
        # The first pass feeds the prompt (no draft); its token is the first one generated.
        (first,) = await self._pass(feed, [len(feed) - 1])
        done = self._take([first], feed[-1], 0, stops)
        while not done:
            history.append(self.final)
            room = self.max_tokens - len(self.result.tokens) - 1
            draft = self.drafter.draft(history, min(self.k, room))[: max(0, room)]
            predictions = await self._pass([self.final, *draft], list(range(len(draft) + 1)))
            kept = _agreeing(draft, predictions)
            self.drafter.observe(predictions, kept)
            self.result.drafted += len(draft)
            self.result.accepted += kept
            history.extend(draft[:kept])
            done = self._take(predictions[: kept + 1], self.final, len(draft), stops)

    def _take(self, new: list[int], pending: int, drafted: int, stops: frozenset[int]) -> bool:
        """Adds a pass's new tokens (the kept draft, then the model's own), which followed
        `pending`; truncates the draft tokens the context holds beyond the ones that stay
        written; True once the generation has ended."""
        tokens = self.result.tokens
        room = self.max_tokens - len(tokens)
        end = next((i for i, t in enumerate(new) if t in stops), None)
        if end is not None and end < room:
            tokens.extend(new[:end])
            self.final, self.result.stop_reason = new[end], "stop_token"
            written = end
        else:
            taken = new[:room]
            tokens.extend(taken)
            self.final = taken[-1]
            self.result.stop_reason = "length" if len(new) >= room else ""
            written = len(taken) - 1
        if drafted > written:
            call(_ctx.truncate, self.ctx.handle, drafted - written)
        self.last_written = new[written - 1] if written else pending
        return bool(self.result.stop_reason)

    async def _pass(self, feed: list[int], indices: list[int]) -> list[int]:
        """Samples at `indices`; the n-th slot draws as generation step `len(tokens) + n`."""
        step = len(self.result.tokens)
        slots = [
            fw.Slot(i, self.sampler.at_step(step + n).slot_op()) for n, i in enumerate(indices)
        ]
        outputs = await run_pass(
            fw.ForwardPass(
                self.ctx.handle, feed, None, None, None, slots, [], None, None, self.ctx.adapter, []
            )
        )
        self.result.passes += 1
        tokens = [out.value for out in outputs]
        if not all(isinstance(t, int) for t in tokens):
            raise TypeError("a sampler slot returned something other than a token")
        return tokens  # type: ignore[return-value]


def _agreeing(draft: list[int], predictions: list[int]) -> int:
    """How many draft tokens the model's predictions confirm, from the first."""
    kept = 0
    while kept < len(draft) and draft[kept] == predictions[kept]:
        kept += 1
    return kept
