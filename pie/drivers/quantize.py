"""Weights kept quantized in memory on the CPU: int8 with one scale per output channel. At run
time each row of activations is quantized to int8 with its own scale, multiplied in int8 with
int32 accumulation (`torch._int_mm`), and scaled back: a quarter of the bytes a float32 weight
streams from memory per step, which is what a CPU decode step waits on.

One scale per row of activations is coarse where a few input channels carry outliers, so the
layers are smoothed first (SmoothQuant): from the activations of a short calibration text, each
input channel j gets a factor s_j = sqrt(max|x_j| / max|W_j|); the weight's column j is
multiplied by s_j before it is quantized and the activations divided by s at run time, which
moves the outliers' range into the weights, where per-row scales absorb it. The output head
stays in the model's dtype (it is usually tied to the embeddings, so it costs no memory, and
int8 there moves the logits the most)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pie.drivers.models.layers import FusedLinear, SplitOutput

_TINY = 1e-12
_FLOOR = 1e-5
SMOOTHING = 0.5
"""SmoothQuant's alpha: how much of the activations' range moves into the weights."""
CALIBRATION = (
    "The harbour town woke slowly. Fishing boats came in with the tide, and the market filled "
    "with voices, crates of mackerel and the smell of salt. A teacher walked her class along "
    "the sea wall to count the gulls; a baker argued with a customer about the price of bread. "
    "In the library, someone was reading about the history of lighthouses, how their lamps "
    "were kept burning through storms, and why each one flashed in its own pattern. def "
    "area(radius):\n    return 3.14159 * radius ** 2\n\nQuestion: What is 12 times 7? "
    "Answer: 84. The capital of France is Paris; the capital of Japan is Tokyo."
)


class Int8Linear(nn.Module):
    """y = x W^T + b with W held as int8 rows and one float32 scale per row (absmax / 127),
    after an optional smoothing of its input channels."""

    qweight: torch.Tensor
    scale: torch.Tensor
    inverse_smoothing: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, smoothing: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        if smoothing is not None:
            weight = weight * smoothing[None, :]
        scale = weight.abs().amax(dim=1).clamp(min=_TINY) / 127.0
        quantized = torch.round(weight / scale[:, None]).to(torch.int8)
        # [in, out] over [out, in] storage: the layout _int_mm reads fastest here.
        self.register_buffer("qweight", quantized.contiguous().t())
        self.register_buffer("scale", scale)
        inverse = None if smoothing is None else (1.0 / smoothing).float()
        self.register_buffer("inverse_smoothing", inverse)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        rows = x.reshape(-1, self.in_features).float()
        if self.inverse_smoothing is not None:
            rows = rows * self.inverse_smoothing
        amax = rows.abs().amax(dim=1, keepdim=True).clamp_(min=_TINY)
        quantized = torch.round(rows * (127.0 / amax)).to(torch.int8)
        out = torch._int_mm(quantized, self.qweight).float()
        out.mul_(amax * (1.0 / 127.0)).mul_(self.scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(dtype)


class Int8FusedLinear(Int8Linear, SplitOutput):
    """A FusedLinear (stacked projections) in int8, split the same way."""

    def __init__(self, linear: FusedLinear, smoothing: torch.Tensor | None = None) -> None:
        super().__init__(linear, smoothing)
        self.split_sizes = list(linear.split_sizes)


def quantize_int8(
    model: nn.Module, calibration: Sequence[int] = (), *, keep: Sequence[str] = ("lm_head",)
) -> int:
    """Replaces the linear layers of `model` (a CausalLM) by their int8 forms, in place, except
    those named in `keep`; smoothed from a forward pass over the `calibration` token ids when
    given. Returns how many layers it replaced."""
    ranges = _input_ranges(model, calibration) if calibration else {}

    def int8(path: str, linear: nn.Linear) -> nn.Module:
        smoothing = _smoothing(linear, ranges[path]) if path in ranges else None
        if isinstance(linear, FusedLinear):
            return Int8FusedLinear(linear, smoothing)
        return Int8Linear(linear, smoothing)

    return replace_linears(model, keep, int8)


def replace_linears(
    model: nn.Module, keep: Sequence[str], convert: Callable[[str, nn.Linear], nn.Module]
) -> int:
    """Puts `convert(path, layer)` in place of every nn.Linear of `model` whose name is not in
    `keep`; how many it replaced."""
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if name in keep or not isinstance(child, nn.Linear):
                continue
            path = f"{parent_name}.{name}" if parent_name else name
            setattr(parent, name, convert(path, child))
            replaced += 1
    return replaced


def _smoothing(linear: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    weights = linear.weight.detach().float().abs().amax(dim=0).clamp(min=_FLOOR)
    factors = inputs.clamp(min=_FLOOR) ** SMOOTHING / weights ** (1 - SMOOTHING)
    return factors.clamp(min=_FLOOR)


def _input_ranges(model: nn.Module, ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Per linear layer, the largest magnitude each input channel took over the text."""
    ranges: dict[str, torch.Tensor] = {}

    def watch(name: str) -> torch.utils.hooks.RemovableHandle:
        def hook(_: nn.Module, inputs: tuple[torch.Tensor, ...], __: torch.Tensor) -> None:
            seen = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1]).abs().amax(0)
            ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen

        return model.get_submodule(name).register_forward_hook(hook)

    handles = [watch(n) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    tokens = torch.tensor(list(ids), dtype=torch.long)
    try:
        with torch.inference_mode():
            model(tokens, torch.arange(len(tokens)), _causal_attention)
    finally:
        for handle in handles:
            handle.remove()
    return ranges


def _causal_attention(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over one sequence (the calibration pass needs no KV pages)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)
