"""One CSM utterance in progress, stepped a frame at a time, and what it is built from: the
dense attention it keeps for itself (its KV lives outside the page pool) and how each
codebook entry is picked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from attrs import frozen

from pie.drivers.models.mimi import causal_attention

if TYPE_CHECKING:
    from pie.drivers.models.csm import CsmForConditionalGeneration


class GrowingCache:
    """An AttentionFn for one sequence whose tokens arrive in order: dense causal attention over
    every key and value it has been given, layer by layer."""

    def __init__(self) -> None:
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if layer in self._kv:
            past_k, past_v = self._kv[layer]
            k, v = torch.cat((past_k, k)), torch.cat((past_v, v))
        self._kv[layer] = (k, v)
        return causal_attention(q, k, v)


@frozen(kw_only=True)
class FrameSampling:
    """How each codebook entry is chosen: argmax, or a draw from the temperature-scaled
    distribution over the top_k logits."""

    greedy: bool = True
    temperature: float = 0.9
    top_k: int = 50
    generator: torch.Generator | None = None

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> a 0-d int64 index."""
        if self.greedy:
            return logits.argmax()
        top = torch.topk(logits.float() / self.temperature, min(self.top_k, logits.numel()))
        probs = torch.softmax(top.values, dim=-1)
        return top.indices[torch.multinomial(probs, 1, generator=self.generator)[0]]


class Utterance:
    """One request's speech in progress, stepped a bounded amount at a time: the first `step`
    runs the prompt and picks frame 0, each later one picks one more frame. It holds its own
    KV (a GrowingCache), dropped with it."""

    def __init__(
        self,
        model: CsmForConditionalGeneration,
        token_ids: list[int],
        max_frames: int,
        sampling: FrameSampling,
    ) -> None:
        self.model, self.max_frames, self.sampling = model, max_frames, sampling
        self._ids = token_ids
        self._cache = GrowingCache()
        self.frames: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        """max_frames frames, or the last one all eos."""
        frames = self.frames
        return bool(frames) and (
            len(frames) >= self.max_frames or self.model._ends_speech(frames[-1])
        )

    def step(self) -> bool:
        """Picks the next frame; whether the utterance is done."""
        assert not self.done, "the utterance is done"
        model, device = self.model, self.model.lm_head.weight.device
        with torch.inference_mode():
            if not self.frames:
                ids = torch.tensor(self._ids, device=device)
                hidden = model(ids, torch.arange(len(ids), device=device), self._cache)[-1]
            else:
                position = len(self._ids) + len(self.frames) - 1
                hidden = model._frame_pass(self.frames[-1], position, self._cache)
            self.frames.append(model._frame(hidden, self.sampling))
        return self.done

    def codes(self) -> torch.Tensor:
        """The frames so far, [frames, num_codebooks] int64 on the CPU."""
        return torch.stack(self.frames).cpu()
