"""Builds the driver an EngineConfig describes (select.py says which): threads, device, dtype,
model, KV pool size, and for the CUDA driver its paged kernels and CUDA graphs."""

from __future__ import annotations

import sys

import torch

from pie.config import EngineConfig
from pie.drivers.base import Driver
from pie.drivers.loader import LoadedModel, load_model
from pie.drivers.select import DriverChoice, choose_driver, load_flashinfer, pick_device, pick_dtype
from pie.drivers.threads import set_threads
from pie.drivers.tokenizer import Tokenizer
from pie.drivers.torch_driver import TorchDriver

__all__ = ["build_driver", "build_torch_driver", "pick_device", "pick_dtype"]


def build_driver(config: EngineConfig) -> tuple[Driver, Tokenizer]:
    """The driver `choose_driver` picks for `config`, with the model loaded onto it."""
    choice = choose_driver(config)
    if choice.driver == "torch":
        return build_torch_driver(config)
    return _build_cuda_driver(config, choice)


def build_torch_driver(config: EngineConfig) -> tuple[TorchDriver, Tokenizer]:
    threads = set_threads(config.driver)
    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    loaded = load_model(config.model.path, dtype, device)
    num_pages = _num_pages(config, loaded, device, dtype)
    _announce(
        loaded,
        device,
        dtype,
        f"{threads} CPU thread{'s' if threads > 1 else ''}",
        num_pages,
        config,
    )
    driver = TorchDriver(
        loaded.model,
        loaded.config,
        page_size=config.kv.page_size,
        num_pages=num_pages,
        max_batch_tokens=config.scheduler.max_batch_tokens,
        max_batch_requests=config.scheduler.max_batch_requests,
        device=device,
        dtype=dtype,
        model_name=loaded.name,
    )
    return driver, loaded.tokenizer


def _build_cuda_driver(config: EngineConfig, choice: DriverChoice) -> tuple[Driver, Tokenizer]:
    from pie.drivers.cuda_driver import CudaDriver

    set_threads(config.driver)
    kernels, version = load_flashinfer()
    assert kernels is not None, version
    loaded = load_model(config.model.path, choice.dtype, choice.device)
    num_pages = _num_pages(config, loaded, choice.device, choice.dtype)
    _announce(
        loaded, choice.device, choice.dtype, f"CUDA driver, flashinfer {version}", num_pages, config
    )
    driver = CudaDriver(
        loaded.model,
        loaded.config,
        kernels=kernels,
        page_size=config.kv.page_size,
        num_pages=num_pages,
        max_batch_tokens=config.scheduler.max_batch_tokens,
        max_batch_requests=config.scheduler.max_batch_requests,
        device=choice.device,
        dtype=choice.dtype,
        model_name=loaded.name,
        graph_batch_sizes=config.driver.graph_batch_sizes if config.driver.cuda_graphs else None,
    )
    return driver, loaded.tokenizer


def _num_pages(config: EngineConfig, loaded: LoadedModel, device: str, dtype: torch.dtype) -> int:
    kv = config.kv
    return kv.num_pages or TorchDriver.pages_for_budget(
        loaded.config, budget_bytes=_kv_budget(config, device), page_size=kv.page_size, dtype=dtype
    )


def _announce(
    loaded: LoadedModel,
    device: str,
    dtype: torch.dtype,
    how: str,
    num_pages: int,
    config: EngineConfig,
) -> None:
    print(
        f"pie: {loaded.name} on {device} ({str(dtype).removeprefix('torch.')}, {how}), "
        f"{num_pages} KV pages of {config.kv.page_size} tokens",
        file=sys.stderr,
    )


def _kv_budget(config: EngineConfig, device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * config.kv.memory_fraction)
    return config.kv.memory_mb * 1024 * 1024
