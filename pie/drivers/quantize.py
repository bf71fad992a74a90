"""Weights kept quantized in memory on the CPU: int8 with one scale per output channel. At run
time each row of activations is quantized to int8 with its own scale, multiplied in int8 with
int32 accumulation (`torch._int_mm`), and scaled back: a quarter of the bytes a float32 weight
streams from memory per step, which is what a CPU decode step waits on."""

from __future__ import annotations

import torch
from torch import nn

from pie.drivers.models.layers import FusedLinear

WEIGHT_FORMATS = ("auto", "int8")
"""`[model] weights`: auto keeps the weights in the model's dtype; int8 quantizes every linear
layer (the output head included) after loading."""
_TINY = 1e-12


class Int8Linear(nn.Module):
    """y = x W^T + b with W held as int8 rows and one float32 scale per row (absmax / 127)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=_TINY) / 127.0
        quantized = torch.round(weight / scale[:, None]).to(torch.int8)
        # [in, out] over [out, in] storage: the layout _int_mm reads fastest here.
        self.register_buffer("qweight", quantized.contiguous().t())
        self.register_buffer("scale", scale)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        rows = x.reshape(-1, self.in_features).float()
        amax = rows.abs().amax(dim=1, keepdim=True).clamp_(min=_TINY)
        quantized = torch.round(rows * (127.0 / amax)).to(torch.int8)
        out = torch._int_mm(quantized, self.qweight).float()
        out.mul_(amax * (1.0 / 127.0)).mul_(self.scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(dtype)


class Int8FusedLinear(Int8Linear):
    """A FusedLinear (stacked projections) in int8, split the same way."""

    def __init__(self, linear: FusedLinear) -> None:
        super().__init__(linear)
        self.split_sizes = list(linear.split_sizes)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self(x).split(self.split_sizes, dim=-1))


def quantize_int8(model: nn.Module) -> int:
    """Replaces every linear layer of `model` by its int8 form, in place; how many it replaced.
    A head tied to the embeddings gets its own int8 copy (the embeddings stay as they are)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedLinear):
                setattr(parent, name, Int8FusedLinear(child))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
            else:
                continue
            replaced += 1
    return replaced
