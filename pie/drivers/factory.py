"""Builds the torch driver an EngineConfig describes: threads, device, dtype, model and KV pool
size."""

from __future__ import annotations

import sys

import torch

from pie.config import EngineConfig
from pie.drivers.loader import load_model
from pie.drivers.threads import set_threads
from pie.drivers.tokenizer import Tokenizer
from pie.drivers.torch_driver import TorchDriver

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch sees no CUDA device")
    return name


def pick_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return _DTYPES[name]


def build_torch_driver(config: EngineConfig) -> tuple[TorchDriver, Tokenizer]:
    threads = set_threads(config.driver)
    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    loaded = load_model(config.model.path, dtype, device)
    kv = config.kv
    num_pages = kv.num_pages or TorchDriver.pages_for_budget(
        loaded.config, budget_bytes=_kv_budget(config, device), page_size=kv.page_size, dtype=dtype
    )
    print(
        f"pie: {loaded.name} on {device} ({str(dtype).removeprefix('torch.')}, "
        f"{threads} CPU thread{'s' if threads > 1 else ''}), "
        f"{num_pages} KV pages of {kv.page_size} tokens",
        file=sys.stderr,
    )
    driver = TorchDriver(
        loaded.model,
        loaded.config,
        page_size=kv.page_size,
        num_pages=num_pages,
        max_batch_tokens=config.scheduler.max_batch_tokens,
        max_batch_requests=config.scheduler.max_batch_requests,
        device=device,
        dtype=dtype,
        model_name=loaded.name,
    )
    return driver, loaded.tokenizer


def _kv_budget(config: EngineConfig, device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * config.kv.memory_fraction)
    return config.kv.memory_mb * 1024 * 1024
