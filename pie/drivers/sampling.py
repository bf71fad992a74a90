"""Reads sampling slots out of a pass's logits: logit masks, samplers and probes over a
[N, vocab] float32 tensor, returning one SlotOutput per slot."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from pie.drivers.host_copies import device_tensor
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


def _token_tensors(
    logits: torch.Tensor, ops: Sequence[SlotOp], generator: torch.Generator
) -> tuple[list[int], list[torch.Tensor]]:
    """The sampler slots, in the order their tokens come: one argmax for all greedy slots and
    one draw per group of identical unseeded samplers, all left on the device."""
    slots: list[int] = []
    tokens: list[torch.Tensor] = []
    greedy = [i for i, op in enumerate(ops) if isinstance(op, Argmax)]
    if greedy:
        index = device_tensor(greedy, torch.long, logits.device)
        slots.extend(greedy)
        tokens.append(logits.index_select(0, index).argmax(dim=-1))
    for members in _draw_groups(ops).values():
        op = ops[members[0]]
        assert isinstance(op, DRAWS)
        index = device_tensor(members, torch.long, logits.device)
        gen = _generator(op.seed, logits.device, generator)
        slots.extend(members)
        tokens.append(draw(logits.index_select(0, index), op, gen))
    return slots, tokens


def _probe_values(logits: torch.Tensor, op: Probe) -> torch.Tensor:
    """What one probe reads from one row of logits [V], flattened (left on the device)."""
    match op:
        case Distribution(k=k, temperature=temperature):
            top = (logits / temperature).softmax(dim=-1).topk(min(k, logits.shape[-1]))
            return torch.cat((top.indices.double(), top.values.double()))
        case RawLogits():
            return logits
        case LogProbs(tokens=wanted):
            index = device_tensor(wanted, torch.long, logits.device)
            return logits.log_softmax(dim=-1).index_select(0, index)
        case Entropy():
            return torch.special.entr(logits.softmax(dim=-1)).sum().view(1)
    raise AssertionError(f"not a probe: {op!r}")


def _probe_output(op: Probe, values: list[float]) -> SlotOutput:
    match op:
        case Distribution():
            half = len(values) // 2
            return DistributionOutput(
                tokens=tuple(int(t) for t in values[:half]), probs=tuple(values[half:])
            )
        case RawLogits():
            return LogitsOutput(values=tuple(values))
        case LogProbs():
            return LogProbsOutput(values=tuple(values))
        case Entropy():
            return EntropyOutput(value=values[0])
    raise AssertionError(f"not a probe: {op!r}")


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Sets logits outside `allowed` ([N, V] bool, or None for no mask) to -inf."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed, float("-inf"))


class SlotReadout:
    """A pass's sampling slots, read out on the device and on their way to the host: every
    token and probe value in one float64 tensor (float64 holds token ids and float32 values
    exactly), copied in one transfer that `outputs` waits for. Until then, `tokens_of` gives
    the sampled tokens on the device, for a pass that feeds them to the next one."""

    def __init__(
        self,
        ops: Sequence[SlotOp],
        token_slots: list[int],
        parts: list[torch.Tensor],
        probes: list[tuple[int, Probe]],
        sizes: list[int],
    ) -> None:
        self.ops = ops
        self.token_slots = token_slots
        self.probes = probes
        self.sizes = sizes
        self._where = {slot: i for i, slot in enumerate(token_slots)}
        self.flat = torch.cat(parts) if parts else None
        self.host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if self.flat is not None and self.flat.is_cuda:
            self.host = torch.empty(self.flat.shape, dtype=self.flat.dtype, pin_memory=True)
            self.host.copy_(self.flat, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        elif self.flat is not None:
            self.host = self.flat

    def samples(self, slot: int) -> bool:
        """Whether `slot` samples a token (rather than probing)."""
        return slot in self._where

    def tokens_of(self, slots: Sequence[int]) -> torch.Tensor:
        """The tokens the sampler slots `slots` drew, int64 on the device (ready in stream
        order: a kernel queued after this pass reads them once they exist)."""
        assert self.flat is not None
        index = device_tensor([self._where[s] for s in slots], torch.long, self.flat.device)
        return self.flat.index_select(0, index).long()

    def outputs(self) -> list[SlotOutput]:
        """One output per slot, in slot order (waits for the copy to the host)."""
        if self.host is None:
            return []
        if self._copied is not None:
            self._copied.synchronize()
        flat: list[float] = self.host.tolist()
        outputs: list[SlotOutput | None] = [None] * len(self.ops)
        for slot, token in zip(self.token_slots, flat, strict=False):
            outputs[slot] = TokenOutput(token=int(token))
        cursor = len(self.token_slots)
        for (i, op), size in zip(self.probes, self.sizes, strict=True):
            outputs[i] = _probe_output(op, flat[cursor : cursor + size])
            cursor += size
        assert all(out is not None for out in outputs)
        return outputs  # type: ignore[return-value]


def launch_slots(
    logits: torch.Tensor,
    ops: Sequence[SlotOp],
    generator: torch.Generator,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> SlotReadout:
    """Samples and probes every slot where the logits are, without waiting for the device;
    row i of `logits` [N, V] belongs to ops[i]. `bias` ([N, V], or None) is added first, then
    the logit mask `allowed` applies."""
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    logits = mask_logits(logits, allowed)
    token_slots, tokens = _token_tensors(logits, ops, generator)
    parts = [t.double() for t in tokens]
    probes = [(i, op) for i, op in enumerate(ops) if isinstance(op, PROBES)]
    sizes = []
    for i, op in probes:
        values = _probe_values(logits[i], op)
        sizes.append(values.numel())
        parts.append(values.double())
    return SlotReadout(ops, token_slots, parts, probes, sizes)


def read_slots(
    logits: torch.Tensor,
    ops: Sequence[SlotOp],
    generator: torch.Generator,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> list[SlotOutput]:
    """One output per slot, in slot order (launch_slots, then its outputs)."""
    return launch_slots(logits, ops, generator, allowed, bias).outputs()
