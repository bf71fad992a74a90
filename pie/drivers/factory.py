"""Builds the driver an EngineConfig describes (select.py says which): threads, device, dtype,
model, KV pool size, and for the CUDA driver its paged kernels and CUDA graphs."""

from __future__ import annotations

import sys
from typing import Any

import torch

from pie.config import EngineConfig
from pie.drivers.base import Driver
from pie.drivers.loader import load_model
from pie.drivers.select import DriverChoice, choose_driver, load_flashinfer, pick_device, pick_dtype
from pie.drivers.threads import set_threads
from pie.drivers.tokenizer import Tokenizer
from pie.drivers.torch_driver import TorchDriver

__all__ = ["build_driver", "build_torch_driver"]


def build_driver(config: EngineConfig) -> tuple[Driver, Tokenizer]:
    """The driver `choose_driver` picks for `config`, with the model loaded onto it."""
    return _build(config, choose_driver(config))


def build_torch_driver(config: EngineConfig) -> tuple[TorchDriver, Tokenizer]:
    """The torch driver on the configured device, whatever else could run."""
    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    return _build(config, DriverChoice(driver="torch", device=device, dtype=dtype, reason=""))


def _build(config: EngineConfig, choice: DriverChoice) -> tuple[TorchDriver, Tokenizer]:
    threads = set_threads(config.driver)
    loaded = load_model(config.model.path, choice.dtype, choice.device)
    weights = _quantize(loaded, config.model.weights, choice.device)
    kv = config.kv
    num_pages = kv.num_pages or TorchDriver.pages_for_budget(
        loaded.config,
        budget_bytes=_kv_budget(config, choice.device),
        page_size=kv.page_size,
        dtype=choice.dtype,
    )
    common: dict[str, Any] = dict(
        page_size=kv.page_size,
        num_pages=num_pages,
        max_batch_tokens=config.scheduler.max_batch_tokens,
        max_batch_requests=config.scheduler.max_batch_requests,
        device=choice.device,
        dtype=choice.dtype,
        model_name=loaded.name,
    )
    if choice.driver == "torch":
        how = f"{weights}{threads} CPU thread{'s' if threads > 1 else ''}"
        _announce(loaded.name, choice, how, num_pages, kv.page_size)
        return TorchDriver(loaded.model, loaded.config, **common), loaded.tokenizer
    from pie.drivers.cuda_driver import CudaDriver

    kernels, version = load_flashinfer()
    assert kernels is not None, version
    _announce(loaded.name, choice, f"CUDA driver, flashinfer {version}", num_pages, kv.page_size)
    graphs = config.driver.graph_batch_sizes if config.driver.cuda_graphs else None
    driver = CudaDriver(
        loaded.model, loaded.config, kernels=kernels, graph_batch_sizes=graphs, **common
    )
    return driver, loaded.tokenizer


def _quantize(loaded: Any, weights: str, device: str) -> str:
    """Applies `[model] weights`; what to say about it at start ("" for the model's dtype)."""
    if weights == "auto":
        return ""
    if device != "cpu":
        raise ValueError(f"[model] weights = {weights!r} runs on the CPU only, not {device}")
    from pie.drivers.quantize import CALIBRATION, quantize_int8

    quantize_int8(loaded.model, loaded.tokenizer.encode(CALIBRATION))
    return "int8 weights, "


def _announce(name: str, choice: DriverChoice, how: str, num_pages: int, page_size: int) -> None:
    print(
        f"pie: {name} on {choice.device} ({str(choice.dtype).removeprefix('torch.')}, {how}), "
        f"{num_pages} KV pages of {page_size} tokens",
        file=sys.stderr,
    )


def _kv_budget(config: EngineConfig, device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * config.kv.memory_fraction)
    return config.kv.memory_mb * 1024 * 1024
