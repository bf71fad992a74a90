"""Reads sampling slots out of a pass's logits: logit masks, samplers and probes over a
[N, vocab] float32 tensor, returning one SlotOutput per slot."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from pie.events.sampling import (
    PROBES,
    Argmax,
    Distribution,
    DistributionOutput,
    Entropy,
    EntropyOutput,
    LogitsOutput,
    LogProbs,
    LogProbsOutput,
    MinP,
    Multinomial,
    Probe,
    RawLogits,
    SlotOp,
    SlotOutput,
    TokenOutput,
    TopK,
    TopKTopP,
    TopP,
)

Draw = Multinomial | TopK | TopP | MinP | TopKTopP
DRAWS = (Multinomial, TopK, TopP, MinP, TopKTopP)


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keeps exactly the k largest logits of each row (ties broken by topk), the rest -inf."""
    k = min(k, logits.shape[-1])
    index = logits.topk(k, dim=-1).indices
    kept = torch.full_like(logits, float("-inf"))
    return kept.scatter(-1, index, logits.gather(-1, index))


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose probability reaches p (at least one)."""
    ordered, index = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    ordered = ordered.masked_fill(mass_before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, index, ordered)


def min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keeps tokens whose probability is at least p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    floor = p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def filtered_logits(logits: torch.Tensor, op: Draw) -> torch.Tensor:
    """Temperature, then the op's filter; what remains is drawn from by softmax."""
    scaled = logits / op.temperature
    match op:
        case Multinomial():
            return scaled
        case TopK(k=k):
            return top_k(scaled, k)
        case TopP(p=p):
            return top_p(scaled, p)
        case MinP(p=p):
            return min_p(scaled, p)
        case TopKTopP(k=k, p=p):
            return top_p(top_k(scaled, k), p)
    raise AssertionError(f"not a stochastic sampler: {op!r}")


def draw(logits: torch.Tensor, op: Draw, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `logits` [M, V] under `op`, as an int64 tensor [M]."""
    probs = filtered_logits(logits, op).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).view(-1)


def _draw_groups(ops: Sequence[SlotOp]) -> dict[Hashable, list[int]]:
    """Slots sharing an unseeded op are drawn together; a seeded slot always draws alone so
    that its token depends only on its own logits and seed, not on the batch around it."""
    groups: dict[Hashable, list[int]] = {}
    for i, op in enumerate(ops):
        if not isinstance(op, DRAWS):
            continue
        key: Hashable = op if op.seed is None else ("seeded", i)
        groups.setdefault(key, []).append(i)
    return groups


def _generator(seed: int | None, device: torch.device, shared: torch.Generator) -> torch.Generator:
    if seed is None:
        return shared
    return torch.Generator(device=device).manual_seed(seed)


def read_tokens(
    logits: torch.Tensor, ops: Sequence[SlotOp], generator: torch.Generator
) -> dict[int, int]:
    """Slot index -> token for every sampler slot; one argmax for all greedy slots, one
    draw per group of identical unseeded samplers, and one host transfer at the end."""
    slots: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    greedy = [i for i, op in enumerate(ops) if isinstance(op, Argmax)]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        slots.append(index)
        tokens.append(logits.index_select(0, index).argmax(dim=-1))
    for members in _draw_groups(ops).values():
        op = ops[members[0]]
        assert isinstance(op, DRAWS)
        index = torch.tensor(members, device=logits.device)
        gen = _generator(op.seed, logits.device, generator)
        slots.append(index)
        tokens.append(draw(logits.index_select(0, index), op, gen))
    if not slots:
        return {}
    return dict(zip(torch.cat(slots).tolist(), torch.cat(tokens).tolist(), strict=True))


def probe(logits: torch.Tensor, op: Probe) -> SlotOutput:
    """One probe over one row of logits [V]."""
    match op:
        case Distribution(k=k, temperature=temperature):
            probs = (logits / temperature).softmax(dim=-1)
            top = probs.topk(min(k, probs.shape[-1]))
            return DistributionOutput(
                tokens=tuple(top.indices.tolist()), probs=tuple(top.values.tolist())
            )
        case RawLogits():
            return LogitsOutput(values=tuple(logits.tolist()))
        case LogProbs(tokens=wanted):
            index = torch.tensor(wanted, dtype=torch.long, device=logits.device)
            values = logits.log_softmax(dim=-1).index_select(0, index)
            return LogProbsOutput(values=tuple(values.tolist()))
        case Entropy():
            return EntropyOutput(value=float(torch.special.entr(logits.softmax(dim=-1)).sum()))
    raise AssertionError(f"not a probe: {op!r}")


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Sets logits outside `allowed` ([N, V] bool, or None for no mask) to -inf."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed, float("-inf"))


def read_slots(
    logits: torch.Tensor,
    ops: Sequence[SlotOp],
    generator: torch.Generator,
    allowed: torch.Tensor | None = None,
) -> list[SlotOutput]:
    """One output per slot, in slot order; row i of `logits` [N, V] belongs to ops[i]."""
    logits = mask_logits(logits, allowed)
    tokens = read_tokens(logits, ops, generator)
    outputs: list[SlotOutput] = []
    for i, op in enumerate(ops):
        if isinstance(op, PROBES):
            outputs.append(probe(logits[i], op))
        else:
            outputs.append(TokenOutput(token=tokens[i]))
    return outputs
