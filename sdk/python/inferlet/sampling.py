"""Samplers (choose a token) and probes (read the distribution) for forward-pass slots.

A seeded sampler is reproducible: generation step `n` draws with seed
`(seed * 1_000_003 + n) mod 2**63`, the same rule as the engine's own `pie generate`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from wit_world.imports import forward as fw

_SEED_MOD = 2**63


@dataclass(frozen=True)
class Sampler:
    """How a slot chooses a token. Build one with the constructors below; temperature and seed
    are keyword-only so `top_p(0.9, temperature=0.6)` cannot be misread."""

    kind: str
    temperature: float = 1.0
    k: int = 0
    p: float = 1.0
    seed: int | None = None

    @staticmethod
    def argmax() -> Sampler:
        return Sampler("argmax")

    @staticmethod
    def multinomial(*, temperature: float = 1.0, seed: int | None = None) -> Sampler:
        return Sampler("multinomial", temperature=temperature, seed=seed)

    @staticmethod
    def top_k(k: int, *, temperature: float = 1.0, seed: int | None = None) -> Sampler:
        return Sampler("top_k", temperature=temperature, k=k, seed=seed)

    @staticmethod
    def top_p(p: float, *, temperature: float = 1.0, seed: int | None = None) -> Sampler:
        return Sampler("top_p", temperature=temperature, p=p, seed=seed)

    @staticmethod
    def min_p(p: float, *, temperature: float = 1.0, seed: int | None = None) -> Sampler:
        return Sampler("min_p", temperature=temperature, p=p, seed=seed)

    @staticmethod
    def top_k_top_p(
        k: int, p: float, *, temperature: float = 1.0, seed: int | None = None
    ) -> Sampler:
        return Sampler("top_k_top_p", temperature=temperature, k=k, p=p, seed=seed)

    def at_step(self, step: int) -> Sampler:
        """This sampler for generation step `step` (a distinct, reproducible seed per step)."""
        if self.seed is None:
            return self
        return replace(self, seed=(self.seed * 1_000_003 + step) % _SEED_MOD)

    def slot_op(self) -> fw.SlotOp:
        t, seed = self.temperature, self.seed
        match self.kind:
            case "argmax":
                return fw.SlotOp_Argmax()
            case "multinomial":
                return fw.SlotOp_Multinomial(fw.MultinomialParams(t, seed))
            case "top_k":
                return fw.SlotOp_TopK(fw.TopKParams(self.k, t, seed))
            case "top_p":
                return fw.SlotOp_TopP(fw.TopPParams(self.p, t, seed))
            case "min_p":
                return fw.SlotOp_MinP(fw.MinPParams(self.p, t, seed))
            case "top_k_top_p":
                return fw.SlotOp_TopKTopP(fw.TopKTopPParams(self.k, self.p, t, seed))
        raise ValueError(f"unknown sampler kind {self.kind!r}")


@dataclass(frozen=True)
class Probe:
    """What a slot reads out instead of choosing a token."""

    kind: str
    k: int = 0
    temperature: float = 1.0
    tokens: tuple[int, ...] = ()

    @staticmethod
    def distribution(k: int, *, temperature: float = 1.0) -> Probe:
        """The k most likely tokens and their probabilities."""
        return Probe("distribution", k=k, temperature=temperature)

    @staticmethod
    def raw_logits() -> Probe:
        """The whole logit vector (after the logit mask)."""
        return Probe("raw_logits")

    @staticmethod
    def logprobs(tokens: list[int] | tuple[int, ...]) -> Probe:
        """Log-probabilities of the given tokens."""
        return Probe("logprobs", tokens=tuple(tokens))

    @staticmethod
    def entropy() -> Probe:
        """Entropy of the distribution, in nats."""
        return Probe("entropy")

    def slot_op(self) -> fw.SlotOp:
        match self.kind:
            case "distribution":
                return fw.SlotOp_Distribution(fw.DistributionParams(self.k, self.temperature))
            case "raw_logits":
                return fw.SlotOp_RawLogits()
            case "logprobs":
                return fw.SlotOp_Logprobs(list(self.tokens))
            case "entropy":
                return fw.SlotOp_Entropy()
        raise ValueError(f"unknown probe kind {self.kind!r}")


@dataclass(frozen=True)
class Distribution:
    """The most likely tokens, most likely first, with their probabilities."""

    tokens: list[int]
    probs: list[float]


SlotResult = int | Distribution | list[float] | float
"""A token (samplers), a Distribution, logits or logprobs (lists), or an entropy."""


def slot_result(out: fw.SlotOutput) -> SlotResult:
    if isinstance(out, fw.SlotOutput_Distribution):
        return Distribution(tokens=list(out.value.tokens), probs=list(out.value.probs))
    return out.value
