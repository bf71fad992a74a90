"""Builds the driver an EngineConfig describes (select.py says which): threads, device, dtype,
model, KV pool size, and for the CUDA driver its paged kernels and CUDA graphs."""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import Any

import attrs
import psutil
import torch

from pie.config import EngineConfig
from pie.drivers.base import Driver
from pie.drivers.loader import fill_weights, open_model
from pie.drivers.lora import LoraAdapters, load_adapters
from pie.drivers.media_store import MediaStore
from pie.drivers.models import CausalLM, ModelConfig
from pie.drivers.models.media import MediaTowers
from pie.drivers.select import DriverChoice, choose_driver, load_flashinfer, pick_device, pick_dtype
from pie.drivers.threads import set_threads
from pie.drivers.tokenizer import Tokenizer
from pie.drivers.torch_driver import TorchDriver

__all__ = ["build_driver", "build_drivers", "build_torch_driver", "model_configs"]


def build_driver(config: EngineConfig) -> tuple[Driver, Tokenizer]:
    """The driver `choose_driver` picks for `config`, with the model loaded onto it."""
    return _build(config, choose_driver(config))


def build_drivers(config: EngineConfig) -> list[tuple[Driver, Tokenizer]]:
    """A driver for each model `config` serves ([[models]], or [model]), in order, each with
    its part of the KV budget; ValueError when two of them end up with one name."""
    built = [build_driver(one) for one in model_configs(config)]
    names = [driver.info.model_name for driver, _ in built]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two models are named {twice}: give each [[models]] entry a name")
    return built


def model_configs(config: EngineConfig) -> list[EngineConfig]:
    """One single-model config per served model: its entry as [model], and [kv]'s budget
    (num_pages, memory_mb or memory_fraction) scaled by its share."""
    if not config.models:
        return [config]
    kv = config.kv
    return [
        attrs.evolve(
            config,
            models=(),
            model=entry,
            kv=attrs.evolve(
                kv,
                num_pages=max(1, int(kv.num_pages * share)) if kv.num_pages else 0,
                memory_mb=max(1, int(kv.memory_mb * share)) if kv.memory_mb else 0,
                memory_fraction=kv.memory_fraction * share,
            ),
        )
        for entry, share in zip(config.model_entries, config.kv_shares(), strict=True)
    ]


def build_torch_driver(config: EngineConfig) -> tuple[TorchDriver, Tokenizer]:
    """The torch driver on the configured device, whatever else could run (one rank: the
    benchmarks that time a driver's own passes)."""
    if config.model.tensor_parallel > 1:
        raise ValueError("this command runs the model on one rank: leave out --tensor-parallel")
    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    return build_rank(config, DriverChoice(driver="torch", device=device, dtype=dtype, reason=""))


def _build(config: EngineConfig, choice: DriverChoice) -> tuple[Driver, Tokenizer]:
    if config.model.tensor_parallel > 1:
        from pie.drivers.tp_ranks import start_ranks

        return start_ranks(config, choice, build_rank)
    return build_rank(config, choice)


def build_rank(
    config: EngineConfig, choice: DriverChoice, rank: int = 0
) -> tuple[TorchDriver, Tokenizer]:
    """The driver of one process: the whole model, or with `[model] tensor_parallel` above 1
    the shard of tensor-parallel rank `rank` (whose layers reduce over torch.distributed)."""
    if config.kv.dtype != "auto" and choice.driver != "torch":
        raise ValueError(f"[kv] dtype = {config.kv.dtype!r} runs on the torch driver only")
    threads = set_threads(config.driver)
    loaded = open_model(config.model.path, choice.dtype, choice.device)
    weights = _weights(loaded, config.model.weights, choice, config.model.tensor_parallel)
    if config.model.tensor_parallel > 1 and weights != "dtype":
        raise ValueError(
            f"[model] weights = {config.model.weights!r} with tensor_parallel: shards hold "
            "float weights only; set weights = 'dtype'"
        )
    # int4 takes the layers a GGUF file holds as blocks from the file, so the float checkpoint
    # never fills them and their float32 form never becomes resident.
    from_file = _file_weights(loaded) if weights == "int4" else None
    fill_weights(loaded, skip=from_file.skip(loaded.model) if from_file is not None else ())
    model_config = _shard(loaded, config.model.tensor_parallel, rank)
    # Before quantizing, which then converts the base layer inside each wrapped one.
    adapters = _adapters(loaded.model, config)
    said = _quantize(loaded, weights, from_file, config.model.activations)
    kv = config.kv
    num_pages = kv.num_pages or _pages_for(config, loaded.config, choice)
    common: dict[str, Any] = dict(
        page_size=kv.page_size,
        num_pages=num_pages,
        max_batch_tokens=config.scheduler.max_batch_tokens,
        max_batch_requests=config.scheduler.max_batch_requests,
        device=choice.device,
        dtype=choice.dtype,
        model_name=config.model.name or loaded.name,
        adapters=adapters,
    )
    if choice.driver == "torch":
        how = f"{said}{threads} CPU thread{'s' if threads > 1 else ''}"
        _announce(common["model_name"], choice, how, num_pages, kv.page_size)
        driver = TorchDriver(
            loaded.model,
            model_config,
            kv_dtype=_kv_dtype(config),
            media=_media_store(loaded, config, common["model_name"]),
            **common,
        )
        _return_freed_memory()
        return driver, loaded.tokenizer
    from pie.drivers.cuda_driver import CudaDriver

    kernels, version = load_flashinfer()
    assert kernels is not None, version
    how = f"CUDA driver, flashinfer {version}"
    _announce(common["model_name"], choice, how, num_pages, kv.page_size)
    graphs = config.driver.graph_batch_sizes if config.driver.cuda_graphs else None
    driver = CudaDriver(
        loaded.model,
        loaded.config,
        kernels=kernels,
        graph_batch_sizes=graphs,
        media=_media_store(loaded, config, common["model_name"]),
        **common,
    )
    return driver, loaded.tokenizer


def _shard(loaded: Any, ranks: int, rank: int) -> ModelConfig:
    """The config the driver sizes its cache by: the model's, or the rank's shard of it after
    cutting the model's layers down to that shard."""
    if ranks == 1:
        config: ModelConfig = loaded.config
        return config
    from pie.drivers.tensor_parallel import rank_share, shard_model
    from pie.drivers.tp_ranks import all_reduce

    return shard_model(loaded.model, rank_share(loaded.config, rank, ranks), all_reduce)


def _media_store(loaded: Any, config: EngineConfig, name: str) -> MediaStore | None:
    """The store of a model with media towers (None for a text model)."""
    if not isinstance(loaded.model, MediaTowers) or not loaded.model.modalities:
        return None
    return MediaStore(
        loaded.model,
        name,
        loaded.tokenizer.encode,
        config.media,
        cache_bytes=config.media.encoder_cache_mb << 20,
    )


def _weights(loaded: Any, weights: str, choice: DriverChoice, ranks: int = 1) -> str:
    """`[model] weights` with "auto" decided: "int4", "int8", or "dtype" (the model's)."""
    if weights == "auto":
        # int4 blocks cannot be cut by heads: tensor-parallel shards keep the model's dtype.
        weights = "auto" if ranks > 1 else _auto_weights(loaded, choice)
    if weights in ("auto", "dtype"):
        return "dtype"
    if choice.device != "cpu":
        raise ValueError(f"[model] weights = {weights!r} runs on the CPU only, not {choice.device}")
    return weights


def _file_weights(loaded: Any) -> Any:
    from pie.drivers.quantize4 import FileWeights

    return FileWeights.read(loaded.path, loaded.model)


def _quantize(loaded: Any, weights: str, from_file: Any, activations: str) -> str:
    """Applies the weights `_weights` chose; what to say about it at start ("" for the dtype)."""
    if activations != "float32" and weights != "int4":
        raise ValueError(
            f"[model] activations = {activations!r} applies to int4 weights, and these are "
            f"{weights}: leave it at 'float32' or set [model] weights = 'int4'"
        )
    if weights == "int4":
        from pie.drivers.quantize4 import to_int4
        from pie.drivers.tiles import int8_activations

        tiled = int8_activations(activations)
        to_int4(loaded.model, from_file, tiled=tiled)
        return f"int4 weights, {'int8' if tiled else 'float32'} activations, "
    if weights == "int8":
        from pie.drivers.quantize import CALIBRATION, quantize_int8

        quantize_int8(loaded.model, loaded.tokenizer.encode(CALIBRATION))
        return "int8 weights, "
    return ""


def _auto_weights(loaded: Any, choice: DriverChoice) -> str:
    """int4 where it is exact and faster: a float32 model on the CPU whose GGUF file holds its
    layers as Q4_0/Q4_1 blocks (int4 then computes what the dequantized model computes, at 1.9x
    its batch-1 decode and no slower elsewhere), when the kernel builds with AVX2 or better;
    "auto" (the model's dtype) otherwise."""
    from pie.drivers.kernels import KernelBuildError, q4_ops
    from pie.drivers.quantize4 import has_q4_layers

    if choice.device != "cpu" or choice.dtype != torch.float32:
        return "auto"
    if not has_q4_layers(loaded.path):
        return "auto"
    try:
        isa = str(q4_ops().isa())
    except KernelBuildError as e:
        print(f"pie: float32 weights: the int4 kernel is unavailable ({e})", file=sys.stderr)
        return "auto"
    return "auto" if isa == "portable" else "int4"


def _adapters(model: CausalLM, config: EngineConfig) -> LoraAdapters | None:
    """The configured LoRA adapters, checked against the model and applied to it."""
    if not config.model.adapters:
        return None
    adapters = load_adapters(
        model,
        config.model.adapters,
        max_adapters=config.model.max_adapters,
        rank_budget=config.model.adapter_rank_budget,
    )
    ranks = ", ".join(f"{name} (r={rank})" for name, rank in adapters.ranks.items())
    print(f"pie: LoRA adapters {ranks}", file=sys.stderr)
    return adapters


def _return_freed_memory() -> None:
    """Hands the heap that loading and quantizing freed back to the system: glibc keeps it
    otherwise (measured: 150 MB of resident memory after int8 quantization)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


def _announce(name: str, choice: DriverChoice, how: str, num_pages: int, page_size: int) -> None:
    print(
        f"pie: {name} on {choice.device} ({str(choice.dtype).removeprefix('torch.')}, {how}), "
        f"{num_pages} KV pages of {page_size} tokens",
        file=sys.stderr,
    )


def _pages_for(config: EngineConfig, model: ModelConfig, choice: DriverChoice) -> int:
    """The KV pool's size when [kv] num_pages leaves it open (see KvConfig.memory_mb)."""
    kv = config.kv
    budget = kv.memory_mb << 20 or int(_free_memory(choice.device) * kv.memory_fraction)
    pages = TorchDriver.pages_for_budget(
        model, budget_bytes=budget, page_size=kv.page_size, dtype=_kv_dtype(config) or choice.dtype
    )
    if kv.memory_mb:
        return pages
    per_context = -(-model.max_position_embeddings // kv.page_size)
    return min(pages, per_context * config.scheduler.max_batch_requests)


def _kv_dtype(config: EngineConfig) -> torch.dtype | None:
    """The KV pages' element type when [kv] dtype sets one (None: the model's)."""
    return torch.int8 if config.kv.dtype == "int8" else None


def _free_memory(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(psutil.virtual_memory().available)
