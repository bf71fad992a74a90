"""`Generation`: the decode loop behind `ctx.generate(...)`, consumed by awaiting it, by
`collect_text()` / `collect_tokens()`, or by `async for piece in ...` (streamed text).

Each step is three host calls (execute, poll, outputs); text is decoded per step only when
streaming or stop strings need it.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any

from wit_world.imports import forward as fw

from inferlet.errors import HostError
from inferlet.forward import run_pass
from inferlet.sampling import Sampler
from inferlet.text import TextStream

if TYPE_CHECKING:
    from inferlet.context import Context

_NO_PAGES = ("out-of-pages", "out_of_pages")


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
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.tokens: list[int] = []
        """Tokens generated so far (a stop token that ended the generation is not included)."""
        self.prompt_tokens = 0
        """Tokens the first pass fed: the queued input (prefill), or 1 when there was none."""
        self.stop_reason: str | None = None
        """"stop_token", "stop_string" or "length" once finished ("error" after a failed step)."""
        self._ctx = ctx
        self._sampler = sampler
        self._op = None if sampler.seed is not None else sampler.slot_op()
        self._max_tokens = max_tokens
        self._stop_tokens = frozenset(stop_tokens)
        stops = tuple(stop_strings)
        self._stream = TextStream(ctx.model, stops) if stops else None
        self._feed: list[int] | None = None
        self._text: str | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    async def collect_tokens(self) -> list[int]:
        while not self.done:
            await self._step()
        return list(self.tokens)

    async def collect_text(self) -> str:
        await self.collect_tokens()
        return self.text

    @property
    def text(self) -> str:
        """The text generated so far (up to, not including, a stop string that ended it)."""
        if self._stream is not None:
            return self._stream.text
        if self._text is None or not self.done:
            self._text = self._ctx.model.decode(self.tokens)
        return self._text

    def __await__(self) -> Generator[Any, None, str]:
        return self.collect_text().__await__()

    def __aiter__(self) -> Generation:
        if self._stream is None:
            if self._feed is not None:
                raise RuntimeError("stream a generation from its start (iterate before awaiting)")
            self._stream = TextStream(self._ctx.model)
        return self

    async def __anext__(self) -> str:
        assert self._stream is not None, "iterate with `async for`"
        while not self.done:
            await self._step()
            piece = self._stream.release()
            if piece:
                return piece
        piece = self._stream.release(final=True)
        if piece:
            return piece
        raise StopAsyncIteration

    async def step(self) -> None:
        """Runs one generation step (one forward pass): for programs that do their own work
        between tokens. Check `done` before each call; `tokens` grows by the step's token."""
        if self.done:
            raise RuntimeError("the generation has finished")
        await self._step()

    async def _step(self) -> None:
        ctx = self._ctx
        if self._feed is None:
            self._feed = self._start()
        feed, step = self._feed, len(self.tokens)
        op = self._op or self._sampler.at_step(step).slot_op()
        pass_ = fw.ForwardPass(ctx.handle, feed, None, None, None, [fw.Slot(len(feed) - 1, op)])
        try:
            token = (await run_pass(pass_))[0].value
        except BaseException:
            self.stop_reason = "error"
            ctx.release(None)
            raise
        assert isinstance(token, int)
        if token in self._stop_tokens:
            return self._finish("stop_token", token, feed[-1])
        self.tokens.append(token)
        if self._stream is not None:
            self._stream.push(token)
            if self._stream.stopped:
                return self._finish("stop_string", token, feed[-1])
        if len(self.tokens) >= self._max_tokens:
            return self._finish("length", token, feed[-1])
        self._feed = [token]

    def _start(self) -> list[int]:
        ctx = self._ctx
        try:
            ctx.acquire()
        except RuntimeError:
            self.stop_reason = "error"
            raise
        try:
            feed = ctx.feed_for_generation()
            self.prompt_tokens = len(feed)
            self._reserve(len(feed) + self._max_tokens - 1)
        except BaseException:
            self.stop_reason = "error"
            ctx.release(None)
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
        if self._stream is not None:
            self._stream.finish()
        ctx = self._ctx
        ctx.release(last_written)
        text = self.text if ctx.chat.cued else ""
        ctx.queue_generated(final, text, stopped_on_token=reason == "stop_token")
