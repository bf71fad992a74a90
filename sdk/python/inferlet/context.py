"""`Context`: a token sequence and its KV cache, with chat helpers and queued (pending) input.

Chat calls and `fill` only queue text (and the media a message holds); text is encoded as one
piece and prefilled by `flush()` or by the first pass of `generate()`, so a whole chat prompt
tokenizes exactly like its render; queued media are written in order before that pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from wit_world.imports import context as _ctx
from wit_world.imports import forward as fw

from inferlet.chat import ChatState, Content, chat_content, split_rendered
from inferlet.errors import call
from inferlet.forward import AttentionWindow, Forward, run_pass
from inferlet.generation import Generation, StepBias
from inferlet.grammar import Grammar, Matcher, grammar_for
from inferlet.media import Media
from inferlet.media import append as append_media
from inferlet.model import Message, Model
from inferlet.sampling import Sampler


class Context:
    """A new empty context on `model`; `Context.open/take` start from a saved snapshot.
    `adapter` names a LoRA adapter of the model (`model.adapters`; default: `model.adapter`)
    that every pass on the context runs through, unless a pass or a generation names another."""

    def __init__(
        self, model: Model, *, adapter: str | None = None, _handle: int | None = None
    ) -> None:
        self.model = model
        self.adapter = adapter or model.adapter
        self.handle = call(_ctx.create, model.handle) if _handle is None else _handle
        self.chat = ChatState(model)
        self._pending: list[str | list[int] | Media] = []
        self._last_token: int | None = None
        self._busy = False
        self._destroyed = False

    @classmethod
    def open(
        cls,
        model: Model,
        name: str,
        *,
        messages: Iterable[Message] = (),
        adapter: str | None = None,
    ) -> Context:
        """A copy of snapshot `name` (which stays). `messages` says which chat messages the
        snapshot holds, so later chat calls queue only what they add."""
        ctx = cls(model, adapter=adapter, _handle=call(_ctx.open, model.handle, name))
        ctx.chat.assume(messages)
        return ctx

    @classmethod
    def take(
        cls,
        model: Model,
        name: str,
        *,
        messages: Iterable[Message] = (),
        adapter: str | None = None,
    ) -> Context:
        """Like `open`, but the snapshot is removed and its pages move to the new context."""
        ctx = cls(model, adapter=adapter, _handle=call(_ctx.take, model.handle, name))
        ctx.chat.assume(messages)
        return ctx

    @staticmethod
    def delete(model: Model, name: str) -> None:
        """Removes snapshot `name`."""
        call(_ctx.delete, model.handle, name)

    # Queued input ---------------------------------------------------------------------------

    def system(self, content: Content) -> Context:
        """Queues a system message as the model's chat template renders it. `content` is text,
        or a list of text and media (`inferlet.Image`, `Video`, `Audio`): each medium goes
        where the template places it, written by `flush()` or before a generation."""
        return self._message("system", content)

    def user(self, content: Content) -> Context:
        return self._message("user", content)

    def assistant(self, content: Content) -> Context:
        return self._message("assistant", content)

    def _message(self, role: str, content: Content) -> Context:
        text, media = chat_content(content)
        added = self.chat.add(role, text)
        for piece in split_rendered(added, media):
            if isinstance(piece, str):
                self.fill(piece)
            else:
                self._pending.append(piece)
        return self

    def cue(self) -> Context:
        """Queues the prompt that starts the assistant's turn."""
        return self.fill(self.chat.cue())

    def fill(self, text: str) -> Context:
        """Queues raw text (no chat template)."""
        if text:
            if self._pending and isinstance(self._pending[-1], str):
                self._pending[-1] += text
            else:
                self._pending.append(text)
        return self

    def fill_tokens(self, tokens: Sequence[int]) -> Context:
        """Queues token ids as they are."""
        if tokens:
            self._pending.append(list(tokens))
        return self

    @property
    def pending(self) -> bool:
        """Whether input is queued that no pass has written yet."""
        return bool(self._pending)

    def take_pending(self) -> list[int]:
        """Encodes the queued input (each run of text in one piece) and clears the queue."""
        tokens: list[int] = []
        for piece in self._pending:
            if isinstance(piece, Media):
                raise RuntimeError("media are queued: await ctx.flush() (or generate) first")
            tokens.extend(self.model.encode(piece) if isinstance(piece, str) else piece)
        self._pending = []
        return tokens

    async def flush(self) -> None:
        """Writes the queued input: each run of text in one pass (no slots), each medium in
        one pass of its own."""
        await self.flush_media()
        tokens = self.take_pending()
        if tokens:
            await self._run_own(_pass(self.handle, tokens, [], self.adapter))

    async def flush_media(self) -> None:
        """Writes the queued input up to its last medium; the text after it stays queued."""
        while media_at := [i for i, p in enumerate(self._pending) if isinstance(p, Media)]:
            first = media_at[0]
            item, rest = self._pending[first], self._pending[first + 1 :]
            assert isinstance(item, Media)
            self._pending = self._pending[:first]
            await self._append(item)
            self._pending = rest + self._pending

    async def append_image(self, image: Any) -> Context:
        """Writes the queued input, then the picture (an `inferlet.Image`) in one pass: the
        model's delimiters around its encoder output."""
        return await self._append(image)

    async def append_video(self, video: Any) -> Context:
        return await self._append(video)

    async def append_audio(self, clip: Any) -> Context:
        return await self._append(clip)

    async def _append(self, item: Media) -> Context:
        await self.flush()
        self.acquire()
        try:
            await append_media(self.handle, item)
        finally:
            self.release(None)
        return self

    # Passes ---------------------------------------------------------------------------------

    def forward(self) -> Forward:
        """A raw forward pass over this context (queued input must be flushed first)."""
        self._check_usable()
        if self._pending:
            raise RuntimeError("the context has queued input: await ctx.flush() before forward()")
        return Forward(self)

    def generate(
        self,
        sampler: Sampler | None = None,
        *,
        max_tokens: int = 256,
        stop_tokens: Iterable[int] | None = None,
        stop_strings: Iterable[str] = (),
        logit_mask: Sequence[int] | None = None,
        deliver_every: int | None = None,
        schema: Mapping[str, Any] | str | bool | None = None,
        regex: str | None = None,
        grammar: str | Grammar | Matcher | None = None,
        logit_bias: Iterable[tuple[Sequence[int], float]] = (),
        step_bias: StepBias | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        window: AttentionWindow | None = None,
        adapter: str | None = None,
    ) -> Generation:
        """Generates up to `max_tokens` tokens; stops at any of `stop_tokens` (default: the model's
        stop tokens) or once the text contains one of `stop_strings`. `logit_mask` (run lengths
        over the vocabulary) limits every step's choice. Nothing runs until the result is
        awaited or iterated; then the engine carries the loop, waking this inferlet every
        `deliver_every` tokens when streaming (default 1) or once at the end.

        Constrained decoding (at most one): `schema` (a JSON Schema as a dict or text; True for
        any JSON), `regex` (the whole output matches it), or `grammar` (Lark text, a `Grammar`,
        or a `Matcher` to continue). The generation ends (`grammar`) once the grammar is
        complete; read it with `collect_json()` for JSON. `logit_bias` adds each `value` to the
        logits of the tokens its `mask` (run lengths) selects, at every step; `step_bias(last)`
        gives more biases for each step from the token fed last (a watermark's green list),
        which makes the generation step in the program. `presence_penalty` and
        `frequency_penalty` (-2..2) lower the logits of tokens the generation has already
        produced, by `frequency * count + presence` (the OpenAI API's rule), in the engine.
        `window` (an `AttentionWindow`) bounds the KV memory of a long generation: every step
        first releases the pages that left the window, keeping the sink pages. `adapter` runs
        every step through that LoRA adapter (default: the context's own, `Context(adapter=)`);
        queued input is prefilled through it too."""
        matcher, owned = _matcher_for(self.model, schema, regex, grammar)
        return Generation(
            self,
            sampler or Sampler.argmax(),
            max_tokens=max_tokens,
            stop_tokens=self.model.stop_tokens if stop_tokens is None else stop_tokens,
            stop_strings=stop_strings,
            logit_mask=logit_mask,
            deliver_every=deliver_every,
            matcher=matcher,
            owns_matcher=owned,
            logit_bias=logit_bias,
            step_bias=step_bias,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            window=window,
            adapter=adapter or self.adapter,
        )

    async def _run_own(self, pass_: fw.ForwardPass) -> list[fw.SlotOutput]:
        self.acquire()
        try:
            outputs = await run_pass(pass_)
        except BaseException:
            self.release(None)
            raise
        self.release(pass_.tokens[-1])
        return outputs

    def acquire(self) -> None:
        """Marks the context busy for one pass or generation; two at once would interleave."""
        self._check_usable()
        if self._busy:
            raise RuntimeError("the context is busy with another pass or generation")
        self._busy = True

    def release(self, last_token: int | None) -> None:
        """Ends a pass or generation; `last_token` is the last token written (None: unknown)."""
        self._busy = False
        self._last_token = last_token

    def queue_generated(self, final: int, text: str, *, stopped_on_token: bool) -> None:
        """Queues the last sampled token (no pass has written it) and, after a chat cue, the text
        the template uses to close the assistant's turn, replacing a stop token it spells out."""
        tail = self.chat.finish_turn(text)
        if tail is None:
            self.fill_tokens([final])
            return
        if stopped_on_token:
            stop_text = self.model.token_texts([final])[0]
            if not tail.startswith(stop_text):
                self.fill(tail)
                return
            tail = tail[len(stop_text) :]
        self.fill_tokens([final]).fill(tail)

    def feed_for_generation(self) -> list[int]:
        """The tokens the first generation pass feeds: the queued input, or else the last written
        token again (after dropping it), because a pass needs an input to read logits at."""
        tokens = self.take_pending()
        if tokens:
            return tokens
        last = self._last_token
        if last is None:
            written = self.tokens
            if not written:
                raise ValueError("nothing to generate from: the context is empty and has no input")
            last = written[-1]
        call(_ctx.truncate, self.handle, 1)
        return [last]

    def reserve(self, count: int) -> None:
        """Allocates pages ahead so `count` more tokens fit without allocating."""
        call(_ctx.reserve, self.handle, count)

    # KV state -------------------------------------------------------------------------------

    def fork(self) -> Context:
        """An O(1) copy sharing this context's pages, with the same queued input and chat."""
        self._check_usable()
        child = Context(self.model, adapter=self.adapter, _handle=call(_ctx.fork, self.handle))
        child._pending = [list(p) if isinstance(p, list) else p for p in self._pending]
        child._last_token = self._last_token
        child.chat = self.chat.copy()
        return child

    def save(self, name: str) -> None:
        """Snapshots the written tokens under `name`; the snapshot outlives this inferlet."""
        self._check_usable()
        if self._pending:
            raise RuntimeError("the context has queued input: await ctx.flush() before save()")
        call(_ctx.save, self.handle, name)

    def truncate(self, count: int) -> None:
        """Drops the last `count` written tokens."""
        call(_ctx.truncate, self.handle, count)
        self._last_token = None

    def mask_pages(self, pages: Iterable[int], masked: bool = True) -> None:
        """Hides (or, with masked=False, shows again) whole KV pages from attention."""
        call(_ctx.mask_pages, self.handle, list(pages), masked)

    def release_pages(self, pages: Iterable[int]) -> None:
        """Gives back the KV of whole written pages no later token attends to; they stay
        masked for good, and the context keeps their tokens (see `AttentionWindow`)."""
        call(_ctx.release_pages, self.handle, list(pages))

    @property
    def tokens(self) -> list[int]:
        """The token ids written so far (queued input not included)."""
        return call(_ctx.tokens, self.handle)

    def info(self) -> _ctx.ContextInfo:
        """Tokens, pages held, reserved pages, next position, masked and released pages."""
        return call(_ctx.info, self.handle)

    def destroy(self) -> None:
        """Releases the context and its pages (also done for every context when main ends)."""
        if not self._destroyed:
            self._destroyed = True
            call(_ctx.destroy, self.handle)

    def _check_usable(self) -> None:
        if self._destroyed:
            raise RuntimeError("the context was destroyed")

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    async def __aenter__(self) -> Context:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"Context({self.handle}, model={self.model.name!r})"


def _matcher_for(
    model: Model,
    schema: Mapping[str, Any] | str | bool | None,
    regex: str | None,
    grammar: str | Grammar | Matcher | None,
) -> tuple[Matcher | None, bool]:
    """The matcher a generation steps with, and whether the generation made it (and frees it)."""
    if isinstance(grammar, Matcher):
        if schema is not None or regex is not None:
            raise ValueError("give at most one of schema, regex and grammar")
        return grammar, False
    compiled = grammar_for(model, schema=schema, regex=regex, grammar=grammar)
    if compiled is None:
        return None, False
    try:
        return compiled.matcher(), True
    finally:
        if compiled is not grammar:
            compiled.free()


def _pass(
    handle: int, tokens: list[int], slots: list[fw.Slot], adapter: str | None
) -> fw.ForwardPass:
    return fw.ForwardPass(
        context=handle,
        tokens=tokens,
        positions=None,
        attention_masks=None,
        logit_mask=None,
        slots=slots,
        logit_bias=[],
        penalty=None,
        window=None,
        adapter=adapter,
        media=[],
    )
