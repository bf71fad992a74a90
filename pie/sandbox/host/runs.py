"""Generation runs: a decode loop the host carries one forward pass at a time from the callback
that delivers each pass's output, so no guest code runs between tokens. A run follows the
guest SDK's `Generation` exactly: the same seeds per step, stop tokens, stop strings matched on
the detokenized text, and the last sampled token left unwritten for the program to queue.
A run given a grammar matcher masks every step with it and feeds it each sampled token; it ends
once the grammar is complete.

On the fast path each step is a lane pass, and the speculator has usually run it already when
the run asks for it; otherwise each step goes through the kv actor. Either way the program's
thread sleeps in `poll` until the run has new tokens for it or has ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs
from attrs import frozen

from pie.events.batching import ForwardCompleted
from pie.events.kv import AttentionWindow, RequestFailed
from pie.events.sampling import LogitBias, Penalty, Rle, SlotOp, TokenOutput
from pie.grammar import GrammarError, Matcher, intersect
from pie.sandbox.host.textstream import Decode, TextStream

SEED_MODULUS = 2**63
SEED_STEP = 1_000_003


def op_at_step(op: SlotOp, step: int) -> SlotOp:
    """The sampler for generation step `step`: a seeded one draws with seed
    `(seed * 1_000_003 + step) mod 2**63`, the guest SDK's rule."""
    seed = getattr(op, "seed", None)
    if seed is None:
        return op
    return attrs.evolve(op, seed=(seed * SEED_STEP + step) % SEED_MODULUS)


@frozen(kw_only=True)
class RunSpec:
    context: int
    feed: tuple[int, ...]
    """What the first pass feeds: the queued input, or the last written token again."""
    op: SlotOp
    max_tokens: int
    stop_tokens: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    logit_mask: Rle | None = None
    logit_bias: tuple[LogitBias, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    """Penalties over the run's own tokens so far, at every step (see `Penalty`)."""
    deliver_every: int = 0
    """Wake the program every this many new tokens; 0: only when the run ends."""
    text: bool = False
    """Detokenize as the run goes (always done when there are stop strings)."""
    window: AttentionWindow | None = None
    """Every step releases the pages that leave this window."""
    adapter: str | None = None
    """The LoRA adapter every step runs through (None: the base model)."""


@frozen(kw_only=True)
class RunOutput:
    tokens: tuple[int, ...]
    """Tokens generated since the last output (a stop token that ended the run excluded)."""
    text: str
    finished: str | None
    """"stop-token", "stop-string", "grammar" (the grammar is complete), "length" or "cancelled"
    once the run has ended."""
    final_token: int | None
    """Once finished: the last sampled token, which no pass has written."""
    last_written: int | None
    """Once finished: the last token the run's passes wrote into the context."""


@frozen
class StepShape:
    """What one step's pass carries besides its feed and sampler."""

    mask: Rle | None = None
    penalty: Penalty | None = None


PLAIN_STEP = StepShape()
"""The shape of every step of a run with no mask and no penalty: no allocation per token."""


Step = Callable[[tuple[int, ...], SlotOp, StepShape, Callable[[Any], None]], None]
"""Submits one pass feeding the tokens with a sampler at the last one, shaped by the step's
mask and penalty; the callback receives its `ForwardCompleted` or `RequestFailed`, on whatever
thread delivers it."""


class Run:
    def __init__(
        self,
        spec: RunSpec,
        step: Step,
        decode: Decode,
        notify: Callable[[], None],
        matcher: Matcher | None = None,
    ) -> None:
        if spec.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not spec.feed:
            raise ValueError("a run needs at least one token to feed")
        self.spec = spec
        self.matcher = matcher
        """Claimed for the run's life: it masks every step and takes every sampled token."""
        self._step = step
        self._notify = notify
        self._cond = threading.Condition()
        self.tokens: list[int] = []
        self._handed = 0
        wants_text = spec.text or bool(spec.stop_strings)
        self._stream = TextStream(decode, spec.stop_strings) if wants_text else None
        self.finished: str | None = None
        self.failure: RequestFailed | None = None
        self._fed: tuple[int, ...] = ()
        self._in_flight = False
        self._cancelled = False
        self._final: int | None = None

    # -- the program's thread ------------------------------------------------------------------

    def start(self) -> None:
        if self.matcher is not None:
            self.matcher.claim()
        try:
            self._submit(self.spec.feed)
        except BaseException:
            self._release_matcher()
            raise

    def cancel(self) -> None:
        """Ends the run after the pass in flight, if any; its token still counts."""
        with self._cond:
            if self.finished is not None:
                return
            self._cancelled = True
            if not self._in_flight:
                self._finish("cancelled", self._final)
        self._notify()

    def wait_settled(self, alive: Callable[[], None], timeout: float = 0.05) -> None:
        """Blocks until no pass of the run is in flight; `alive` raises when the program must
        stop waiting (it is checked between waits)."""
        with self._cond:
            while self._in_flight:
                alive()
                self._cond.wait(timeout)

    def ready(self) -> bool:
        with self._cond:
            return self._ready()

    def take(self) -> RunOutput:
        """What the program has not seen yet; raises the failure that ended the run, if any."""
        with self._cond:
            if self.failure is not None:
                failure, self.failure = self.failure, None
                raise RunFailed(failure)
            tokens = tuple(self.tokens[self._handed :])
            self._handed = len(self.tokens)
            done = self.finished is not None
            text = self._stream.release(final=done) if self._stream is not None else ""
            return RunOutput(
                tokens=tokens,
                text=text,
                finished=self.finished,
                final_token=self._final if done else None,
                last_written=self._fed[-1] if done and self._fed else None,
            )

    # -- whichever thread delivers a pass ------------------------------------------------------

    def _submit(self, feed: tuple[int, ...]) -> None:
        with self._cond:
            self._in_flight = True
            self._fed = feed
            op = op_at_step(self.spec.op, len(self.tokens))
            penalty = self._penalty()
        try:
            mask = self._step_mask()
        except GrammarError as exc:
            self._delivered(RequestFailed(corr=0, kind=exc.kind, message=str(exc)))
            return
        shape = PLAIN_STEP if mask is None and penalty is None else StepShape(mask, penalty)
        self._step(feed, op, shape, self._delivered)

    def _penalty(self) -> Penalty | None:
        spec = self.spec
        if not (spec.presence_penalty or spec.frequency_penalty):
            return None
        return Penalty(
            presence=spec.presence_penalty,
            frequency=spec.frequency_penalty,
            tokens=tuple(self.tokens),
        )

    def _step_mask(self) -> Rle | None:
        matcher = self.matcher
        if matcher is None:
            return self.spec.logit_mask
        return intersect(self.spec.logit_mask, matcher.mask(), matcher.vocab_size)

    def _delivered(self, value: Any) -> None:
        with self._cond:
            self._in_flight = False
            following = self._advance(value)
            wake = self._ready()
            self._cond.notify_all()
        if wake:
            self._notify()
        if following is not None:
            self._submit(following)

    def _advance(self, value: Any) -> tuple[int, ...] | None:
        """Takes in a pass's outcome; the next pass's feed, or None when the run is over."""
        if isinstance(value, RequestFailed):
            self.failure = value
            self._finish("error", None)
            return None
        token = _token(value)
        self._final = token
        if self.matcher is not None and not self._grammar_takes(token):
            return None
        if token in self.spec.stop_tokens:
            self._finish("stop-token", token)
            return None
        self.tokens.append(token)
        stream = self._stream
        if stream is not None:
            stream.push(token)
            if stream.stopped:
                self._finish("stop-string", token)
                return None
        if self.matcher is not None and self.matcher.stopped:
            self._finish("grammar", token)
            return None
        if len(self.tokens) >= self.spec.max_tokens:
            self._finish("length", token)
            return None
        if self._cancelled:
            self._finish("cancelled", token)
            return None
        return (token,)

    def _grammar_takes(self, token: int) -> bool:
        """Feeds the matcher the sampled token; a refusal (a mask the sampler did not honour, or
        a matcher in error) ends the run with a failure."""
        assert self.matcher is not None
        try:
            if self.matcher.consume((token,)) == 1:
                return True
            message = f"the grammar refused the sampled token {token}"
        except GrammarError as exc:
            message = str(exc)
        self.failure = RequestFailed(corr=0, kind="invalid", message=message)
        self._finish("error", None)
        return False

    def _finish(self, reason: str, final: int | None) -> None:
        self.finished = reason
        self._final = final
        if self._stream is not None:
            self._stream.finish()
        self._release_matcher()

    def _release_matcher(self) -> None:
        if self.matcher is not None:
            self.matcher.release()

    def _ready(self) -> bool:
        if self.finished is not None:
            return True
        every = self.spec.deliver_every
        return every > 0 and len(self.tokens) - self._handed >= every


class RunFailed(Exception):
    """A pass of the run failed: `failure` says how."""

    def __init__(self, failure: RequestFailed) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _token(value: Any) -> int:
    if not isinstance(value, ForwardCompleted) or len(value.outputs) != 1:
        raise TypeError(f"a run's pass answered {value!r}")
    output = value.outputs[0]
    if not isinstance(output, TokenOutput):
        raise TypeError(f"a run's sampler answered {output!r}")
    return output.token
