"""Green-list watermarks: at every step a pseudo-random share `gamma` of the vocabulary, drawn
from a secret key and the token before, gets `delta` added to its logits, so watermarked text
holds far more "green" tokens than chance. `z_score` tells them apart knowing only the key and
the tokens. The green list is made of blocks of `block` consecutive token ids, so its mask is a
few hundred run lengths rather than a list of half the vocabulary."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from inferlet.forward import runs

if TYPE_CHECKING:
    from inferlet.context import Context
    from inferlet.generation import Generation
    from inferlet.sampling import Sampler


class Watermark:
    def __init__(
        self, key: int, vocab_size: int, *, gamma: float = 0.5, delta: float = 4.0, block: int = 64
    ) -> None:
        if not 0 < gamma < 1 or block < 1:
            raise ValueError("gamma must be in (0, 1) and block at least 1")
        self.key = key
        self.vocab_size = vocab_size
        self.gamma = gamma
        self.delta = delta
        self.block = block
        self._blocks = -(-vocab_size // block)
        self._cache: dict[int, frozenset[int]] = {}

    def green_blocks(self, previous: int) -> frozenset[int]:
        """The blocks of token ids that are green after `previous`."""
        blocks = self._cache.get(previous)
        if blocks is None:
            rng = random.Random(self.key * 1_000_003 + previous)
            count = max(1, round(self.gamma * self._blocks))
            blocks = frozenset(rng.sample(range(self._blocks), count))
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[previous] = blocks
        return blocks

    def is_green(self, previous: int, token: int) -> bool:
        return token // self.block in self.green_blocks(previous)

    def bias(self, previous: int) -> list[tuple[list[int], float]]:
        """The step's logit bias: `delta` on the green list after `previous`."""
        green = self.green_blocks(previous)
        lengths = [n * self.block for n in runs(b in green for b in range(self._blocks))]
        lengths[-1] -= self._blocks * self.block - self.vocab_size  # the last block is short
        return [(lengths, self.delta)]

    def generate(
        self, ctx: Context, sampler: Sampler | None = None, **options: object
    ) -> Generation:
        """`ctx.generate(...)` with the watermark's bias at every step."""
        return ctx.generate(sampler, step_bias=self.bias, **options)  # type: ignore[arg-type]

    def z_score(self, tokens: Sequence[int], previous: int) -> float:
        """How many standard deviations the green tokens of `tokens` (the first following
        `previous`) lie above what unwatermarked text would hold."""
        if not tokens:
            return 0.0
        green, last = 0, previous
        for token in tokens:
            green += self.is_green(last, token)
            last = token
        n = len(tokens)
        return (green - self.gamma * n) / math.sqrt(n * self.gamma * (1 - self.gamma))
