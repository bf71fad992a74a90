"""`Forward`: one raw forward pass over a context, built step by step and executed once.

Masks are run lengths of a boolean mask that alternate true/false starting with true (a leading
0 starts with false); `runs([True, True, False])` builds one from booleans.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wit_world.imports import forward as fw

from inferlet import _loop
from inferlet.errors import call
from inferlet.sampling import Probe, Sampler, SlotResult, slot_result

if TYPE_CHECKING:
    from inferlet.context import Context
    from inferlet.model import Model


def runs(mask: Iterable[bool]) -> list[int]:
    """Run lengths of a boolean mask, in the form passes take (starting with a true run)."""
    lengths: list[int] = []
    current, count = True, 0
    for value in mask:
        if bool(value) != current:
            lengths.append(count)
            current, count = not current, 0
        count += 1
    lengths.append(count)
    return lengths


@dataclass(frozen=True)
class AttentionWindow:
    """Attention sinks plus a sliding window, in KV pages: a pass (or every step of a
    generation) given one first releases every full page after the first `sink_pages` that
    is not among the last `window_pages` (the page being written counts as one), so a long
    generation holds at most `sink_pages + window_pages` pages. Released pages stay hidden
    from attention for good; the context keeps their tokens and positions."""

    window_pages: int
    sink_pages: int = 1

    @classmethod
    def tokens(cls, model: Model, window: int, sinks: int = 1) -> AttentionWindow:
        """The window that keeps at least the last `window` tokens and the first `sinks`."""
        size = model.page_size
        return cls(window_pages=-(-window // size) + 1, sink_pages=-(-sinks // size))

    def wit(self) -> fw.AttentionWindow:
        return fw.AttentionWindow(sink_pages=self.sink_pages, window_pages=self.window_pages)


async def run_pass(pass_: fw.ForwardPass) -> list[fw.SlotOutput]:
    """Runs a pass: in one host call that blocks while nothing else on the loop could run,
    otherwise submitted, awaited on the loop (so other branches batch with it) and read."""
    if _loop.idle():
        return call(fw.step, pass_)
    handle = call(fw.execute, pass_)
    await _loop.ready(handle)
    return call(fw.outputs, handle)


class Forward:
    """A pass under construction: `ctx.forward().input(ids).sample([len(ids) - 1], s)`, then
    `await fwd.execute()` returns one result per slot in the order the slots were added."""

    def __init__(self, context: Context) -> None:
        self._context = context
        self._tokens: list[int] = []
        self._positions: list[int] | None = None
        self._attention: list[list[int]] | None = None
        self._logit_mask: list[int] | None = None
        self._logit_bias: list[fw.LogitBias] = []
        self._slots: list[fw.Slot] = []
        self._window: AttentionWindow | None = None
        self._adapter: str | None = context.adapter
        self._media: list[fw.MediaInput] = []
        self._done = False

    def input(self, tokens: Sequence[int], positions: Sequence[int] | None = None) -> Forward:
        """Appends tokens (with explicit positions, or continuing after the context's last)."""
        if positions is not None and len(positions) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(positions)} positions")
        if positions is None and self._positions is not None:
            raise ValueError("give positions for every input once any input has them")
        if positions is not None:
            if self._media:
                raise ValueError("a pass with media takes no positions")
            if self._tokens and self._positions is None:
                raise ValueError("give positions for every input once any input has them")
            self._positions = (self._positions or []) + list(positions)
        self._tokens.extend(tokens)
        return self

    def input_image(self, image: Any, anchor: int | None = None) -> Forward:
        """Puts an `inferlet.Image`'s whole span (delimiters and soft tokens) into the input
        just before input token `anchor` (default: after the tokens given so far). Slot indices
        and attention masks then count the span's tokens too (`image.token_count()`)."""
        return self._input_media(image, anchor)

    def input_video(self, video: Any, anchor: int | None = None) -> Forward:
        """As `input_image`, for an `inferlet.Video`."""
        return self._input_media(video, anchor)

    def input_audio(self, clip: Any, anchor: int | None = None) -> Forward:
        """As `input_image`, for an `inferlet.Audio`."""
        return self._input_media(clip, anchor)

    def _input_media(self, item: Any, anchor: int | None) -> Forward:
        if self._positions is not None:
            raise ValueError("a pass with media takes no positions")
        at = len(self._tokens) if anchor is None else anchor
        self._media.append(fw.MediaInput(media=item.handle, anchor=at))
        return self

    def attention_mask(self, masks: Sequence[Sequence[int]]) -> Forward:
        """Per input token, run lengths over the context's tokens (old and new) it attends to."""
        self._attention = [list(m) for m in masks]
        return self

    def logit_mask(self, mask: Sequence[int]) -> Forward:
        """Run lengths over the vocabulary: which tokens samplers may choose."""
        self._logit_mask = list(mask)
        return self

    def logit_bias(self, mask: Sequence[int], value: float) -> Forward:
        """Adds `value` (-100..100) to the logits of the tokens `mask` (run lengths over the
        vocabulary) selects, at every slot; several biases add up."""
        self._logit_bias.append(fw.LogitBias(list(mask), value))
        return self

    def window(self, window: AttentionWindow) -> Forward:
        """Releases the pages that leave `window` before the pass runs."""
        self._window = window
        return self

    def adapter(self, name: str | None) -> Forward:
        """Runs the pass through LoRA adapter `name` (None: the base model) instead of the
        context's own adapter."""
        self._adapter = name
        return self

    def sample(self, indices: Iterable[int], sampler: Sampler) -> Forward:
        """A sampling slot at each of `indices` (positions within this pass's input)."""
        op = sampler.slot_op()
        self._slots.extend(fw.Slot(index=i, op=op) for i in indices)
        return self

    def probe(self, indices: Iterable[int], probe: Probe) -> Forward:
        op = probe.slot_op()
        self._slots.extend(fw.Slot(index=i, op=op) for i in indices)
        return self

    async def execute(self) -> list[SlotResult]:
        if self._done:
            raise RuntimeError("this forward pass was already executed")
        if not self._tokens and not self._media:
            raise ValueError("a forward pass needs at least one input token or medium")
        self._done = True
        pass_ = fw.ForwardPass(
            context=self._context.handle,
            tokens=self._tokens,
            positions=self._positions,
            attention_masks=self._attention,
            logit_mask=self._logit_mask,
            slots=self._slots,
            logit_bias=self._logit_bias,
            penalty=None,
            window=None if self._window is None else self._window.wit(),
            adapter=self._adapter,
            media=self._media,
        )
        run = self._run_with_media if self._media else self._context._run_own
        outputs = await run(pass_)
        return [slot_result(out) for out in outputs]

    async def _run_with_media(self, pass_: fw.ForwardPass) -> list[fw.SlotOutput]:
        """Runs a pass whose last written token the program does not know (a span's tokens
        are the engine's)."""
        self._context.acquire()
        try:
            return await run_pass(pass_)
        finally:
            self._context.release(None)
