"""Host values on their way to the device without waiting for it: a copy that blocks would wait
for every pass already queued on the stream, which undoes launching one pass while another runs
(TorchDriver.launch)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, copied in stream order without a host wait."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied in stream order without a host wait."""
    return tensor.to(device, non_blocking=True)
