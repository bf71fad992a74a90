"""`Generation`: the decode loop behind `ctx.generate(...)`, consumed by awaiting it, by
`collect_text()` / `collect_tokens()`, or by `async for piece in ...` (streamed text).

Consumed whole or streamed, it is a generation run: the engine carries the loop, one pass per
token, with no inferlet code between tokens, and wakes the inferlet when it has tokens for it
(every `deliver_every` tokens, or at the end). `step()` drives it one pass at a time instead,
for programs that act between tokens; both give the same tokens. With a grammar matcher every
step is masked by it and the generation ends once the grammar is complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from wit_world.imports import forward as fw
from wit_world.imports import generate as gen

from inferlet import _loop
from inferlet.errors import HostError, call
from inferlet.forward import AttentionWindow, run_pass
from inferlet.grammar import Matcher, intersect
from inferlet.sampling import Sampler
from inferlet.text import TextStream

if TYPE_CHECKING:
    from inferlet.context import Context

_NO_PAGES = ("out-of-pages", "out_of_pages")

StepBias = Callable[[int], Sequence[tuple[Sequence[int], float]]]
"""Given the token fed last, the (run-length mask, value) biases of the next step."""
_REASONS = {"stop-token": "stop_token", "stop-string": "stop_string"}


class Generation:
    """One generation on a context; made by `ctx.generate(...)`, run when consumed."""

    def __init__(
        self,
        ctx: Context,
        sampler: Sampler,
        *,
        max_tokens: int,
        stop_tokens: Iterable[int],
        stop_strings: Iterable[str],
        logit_mask: Sequence[int] | None = None,
        deliver_every: int | None = None,
        matcher: Matcher | None = None,
        owns_matcher: bool = False,
        logit_bias: Iterable[tuple[Sequence[int], float]] = (),
        step_bias: StepBias | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        window: AttentionWindow | None = None,
        adapter: str | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if deliver_every is not None and deliver_every < 1:
            raise ValueError("deliver_every must be at least 1")
        self.tokens: list[int] = []
        """Tokens generated so far (a stop token that ended the generation is not included)."""
        self.prompt_tokens = 0
        """Tokens the first pass fed: the queued input (prefill), or 1 when there was none."""
        self.stop_reason: str | None = None
        """"stop_token", "stop_string", "grammar" (the grammar is complete), "length" or
        "cancelled" once finished ("error" after a failed pass)."""
        self._ctx = ctx
        self._sampler = sampler
        self._op = None if sampler.seed is not None else sampler.slot_op()
        self._max_tokens = max_tokens
        self._stop_tokens = frozenset(stop_tokens)
        self._stops = tuple(s for s in stop_strings if s)
        self._logit_mask = None if logit_mask is None else list(logit_mask)
        self._deliver_every = deliver_every
        self.matcher = matcher
        """The grammar matcher constraining every step; it stands after the last token."""
        self._owns_matcher = owns_matcher
        self._logit_bias = [fw.LogitBias(list(mask), value) for mask, value in logit_bias]
        self._step_bias = step_bias
        self._penalties = (presence_penalty, frequency_penalty)
        self._window = None if window is None else window.wit()
        self._adapter = adapter
        self._stream = TextStream(ctx.model, self._stops) if self._stops else None
        self._feed: list[int] | None = None
        self._run: int | None = None
        self._streaming = False
        self._pieces: list[str] = []
        self._run_text: list[str] | None = None
        self._text: str | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    async def collect_tokens(self) -> list[int]:
        # A bias that changes per step needs the program between tokens: it is stepped.
        if self._feed is None and not self.done and self._step_bias is None:
            await self._run_to(None)
        while not self.done:
            await self._step()
        return list(self.tokens)

    async def collect_text(self) -> str:
        await self.collect_tokens()
        return self.text

    async def collect_json(self) -> Any:
        """The generated text parsed as JSON (ValueError, naming the stop reason, when it is
        not: a generation cut short by `max_tokens` ends mid-value)."""
        text = await self.collect_text()
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(
                f"the generation ({self.stop_reason}) is not JSON: {exc}: {text[:200]!r}"
            ) from None

    @property
    def text(self) -> str:
        """The text generated so far (up to, not including, a stop string that ended it)."""
        if self._run_text is not None:
            return "".join(self._run_text)
        if self._stream is not None:
            return self._stream.text
        if self._text is None or not self.done:
            self._text = self._ctx.model.decode(self.tokens)
        return self._text

    def __await__(self) -> Generator[Any, None, str]:
        return self.collect_text().__await__()

    def __aiter__(self) -> Generation:
        if self._feed is not None or self._run is not None:
            raise RuntimeError("stream a generation from its start (iterate before awaiting)")
        if self._step_bias is not None:
            raise RuntimeError("a generation with a step bias is stepped, not streamed")
        self._streaming = True
        return self

    async def __anext__(self) -> str:
        assert self._streaming, "iterate with `async for`"
        while not self._pieces and not self.done:
            await self._run_to(self._deliver_every or 1)
        if self._pieces:
            return self._pieces.pop(0)
        raise StopAsyncIteration

    async def step(self) -> None:
        """Runs one generation step (one forward pass): for programs that do their own work
        between tokens. Check `done` before each call; `tokens` grows by the step's token."""
        if self.done:
            raise RuntimeError("the generation has finished")
        if self._run is not None:
            raise RuntimeError("the generation runs in the engine: consume it whole or stream it")
        await self._step()

    # -- a run carried by the engine -------------------------------------------------------------

    async def _run_to(self, deliver_every: int | None) -> None:
        """Starts the run if needed and waits for its next output (its end when
        `deliver_every` is None)."""
        if self._run is None:
            await self._ctx.flush_media()
            self._start_run(deliver_every or 0)
        assert self._run is not None
        pending = call(gen.next, self._run)
        try:
            await _loop.ready(pending)
            out = call(gen.output, pending)
        except BaseException:
            self._abandon_run()
            raise
        self._take_output(out)

    def _start_run(self, deliver_every: int) -> None:
        feed = self._start()
        text = self._streaming or bool(self._stops)
        self._run_text = [] if text else None
        self._stream = None
        params = gen.RunParams(
            context=self._ctx.handle,
            tokens=feed,
            sampler=self._sampler.slot_op(),
            max_tokens=self._max_tokens,
            stop_tokens=sorted(self._stop_tokens),
            stop_strings=list(self._stops),
            logit_mask=self._logit_mask,
            deliver_every=deliver_every,
            text=text,
            matcher=None if self.matcher is None else self.matcher.handle,
            logit_bias=self._logit_bias,
            presence_penalty=self._penalties[0],
            frequency_penalty=self._penalties[1],
            window=self._window,
            adapter=self._adapter,
        )
        try:
            self._run = call(gen.start, params)
        except BaseException:
            self._failed()
            raise

    def _take_output(self, out: gen.RunOutput) -> None:
        self.tokens.extend(out.tokens)
        if self._run_text is not None and out.text:
            self._run_text.append(out.text)
            if self._streaming:
                self._pieces.append(out.text)
        if out.finished is None:
            return
        reason = _REASONS.get(out.finished, out.finished)
        assert out.final_token is not None and out.last_written is not None
        self._finish(reason, out.final_token, out.last_written)

    def _abandon_run(self) -> None:
        """The run's output could not be read (a failed pass, or the task was cancelled)."""
        run, self._run = self._run, None
        if run is not None:
            try:
                call(gen.cancel, run)
            except HostError:
                pass
        self._failed()

    def _failed(self) -> None:
        self.stop_reason = "error"
        self._free_matcher()
        self._ctx.release(None)

    def _free_matcher(self) -> None:
        if self._owns_matcher and self.matcher is not None:
            self._owns_matcher = False
            try:
                self.matcher.free()
            except HostError:
                pass

    # -- the per-step loop -----------------------------------------------------------------------

    async def _step(self) -> None:
        ctx = self._ctx
        if self._feed is None:
            await ctx.flush_media()
            self._feed = self._start()
        feed, step = self._feed, len(self.tokens)
        op = self._op or self._sampler.at_step(step).slot_op()
        matcher = self.matcher
        try:
            mask = self._logit_mask
            if matcher is not None:
                mask = intersect(mask, matcher.mask())
            bias = self._logit_bias
            if self._step_bias is not None:
                bias = bias + [fw.LogitBias(list(m), v) for m, v in self._step_bias(feed[-1])]
            pass_ = fw.ForwardPass(
                ctx.handle,
                feed,
                None,
                None,
                mask,
                [fw.Slot(len(feed) - 1, op)],
                bias,
                self._penalty(),
                self._window,
                self._adapter,
                [],
            )
            token = (await run_pass(pass_))[0].value
            assert isinstance(token, int)
            if matcher is not None and matcher.consume([token]) != 1:
                raise HostError("invalid", f"the grammar refused the sampled token {token}")
        except BaseException:
            self._failed()
            raise
        if token in self._stop_tokens:
            return self._finish("stop_token", token, feed[-1])
        self.tokens.append(token)
        if self._stream is not None:
            self._stream.push(token)
            if self._stream.stopped:
                return self._finish("stop_string", token, feed[-1])
        if matcher is not None and matcher.stopped:
            return self._finish("grammar", token, feed[-1])
        if len(self.tokens) >= self._max_tokens:
            return self._finish("length", token, feed[-1])
        self._feed = [token]

    def _penalty(self) -> fw.Penalty | None:
        """The step's penalties over the tokens generated so far (the engine's run rule)."""
        presence, frequency = self._penalties
        if not (presence or frequency):
            return None
        return fw.Penalty(presence, frequency, list(self.tokens))

    def _start(self) -> list[int]:
        ctx = self._ctx
        try:
            ctx.acquire()
        except RuntimeError:
            self.stop_reason = "error"
            self._free_matcher()
            raise
        try:
            feed = ctx.feed_for_generation()
            self.prompt_tokens = len(feed)
            # A windowed generation holds a bounded number of pages: nothing to reserve.
            if self._window is None:
                self._reserve(len(feed) + self._max_tokens - 1)
        except BaseException:
            self._failed()
            raise
        return feed

    def _reserve(self, count: int) -> None:
        try:
            self._ctx.reserve(count)
        except HostError as err:
            # Reserving only saves allocations; decoding still allocates page by page.
            if err.kind not in _NO_PAGES:
                raise

    def _finish(self, reason: str, final: int, last_written: int) -> None:
        """The last sampled token is not written yet: it stays queued in the context, so the
        context holds everything generated (a chat turn is closed as the template renders it)."""
        self.stop_reason = reason
        self._run = None
        self._free_matcher()
        if self._stream is not None:
            self._stream.finish()
        ctx = self._ctx
        ctx.release(last_written)
        text = self.text if ctx.chat.cued else ""
        ctx.queue_generated(final, text, stopped_on_token=reason == "stop_token")
