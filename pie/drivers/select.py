"""Which driver runs the model, and why: the CUDA driver where a GPU, flashinfer and a bfloat16
or float16 model are all there, else the torch driver (on the GPU when there is one)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from attrs import frozen

from pie.config import EngineConfig

PAGED_DTYPES = (torch.bfloat16, torch.float16)
"""The element types flashinfer's paged kernels run."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@frozen(kw_only=True)
class DriverChoice:
    driver: str
    """"cuda" or "torch"."""
    device: str
    dtype: torch.dtype
    reason: str


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


def load_flashinfer() -> tuple[ModuleType | None, str]:
    """The flashinfer module and its version, or None and why it cannot be imported."""
    try:
        module = importlib.import_module("flashinfer")
    except ImportError as err:
        return None, f"flashinfer is not installed (pip install '.[cuda]'): {err}"
    except Exception as err:  # a broken install fails in many ways; say which
        return None, f"flashinfer failed to import: {type(err).__name__}: {err}"
    return module, str(getattr(module, "__version__", "unknown"))


def choose_driver(config: EngineConfig) -> DriverChoice:
    """The driver `config` asks for, or the best one that can run; raises RuntimeError when
    `[driver] backend = "cuda"` cannot run, naming every reason."""
    device = pick_device(config.model.device)
    dtype = pick_dtype(config.model.dtype, device)
    backend = config.driver.backend
    if backend == "torch":
        return DriverChoice(
            driver="torch", device=device, dtype=dtype, reason="[driver] backend = torch"
        )
    problems = []
    if not device.startswith("cuda"):
        problems.append(f"the device is {device}, not a CUDA GPU")
    if dtype not in PAGED_DTYPES:
        name = str(dtype).removeprefix("torch.")
        problems.append(f"the model runs in {name} (flashinfer runs bfloat16 or float16)")
    version = ""
    if not problems:
        module, version = load_flashinfer()
        if module is None:
            problems.append(version)
    if not problems:
        reason = f"a CUDA GPU, flashinfer {version} and a {str(dtype).removeprefix('torch.')} model"
        return DriverChoice(driver="cuda", device=device, dtype=dtype, reason=reason)
    if backend == "cuda":
        raise RuntimeError("[driver] backend = cuda cannot run: " + "; ".join(problems))
    return DriverChoice(
        driver="torch",
        device=device,
        dtype=dtype,
        reason="the CUDA driver cannot run: " + "; ".join(problems),
    )
