"""Where the engine's memory goes: the process's resident total, split into the model's
tensors, the KV pages passes have used, and the rest (interpreter, libraries, guests). It
imports no torch: the engine sets torch's threading up before torch first loads."""

from __future__ import annotations

from typing import Any

import psutil
from attrs import frozen

_MIB = 1 << 20


@frozen(kw_only=True)
class MemoryUse:
    """Sizes in MiB. `model` and `kv_used` count host memory only when the driver runs on the
    CPU; on a GPU they are device memory and `other` is the whole resident total."""

    resident: float
    model: float
    kv_used: float
    kv_pool: float
    """The pool's full size; on the CPU its pages become resident only once a pass uses them."""
    other: float
    on_device: str


def peak_resident_mb() -> float:
    """This process's peak resident memory in MiB: VmHWM, which starts afresh at exec, where
    getrusage's ru_maxrss keeps the high-water mark of the process that spawned this one."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_bytes(model: Any) -> int:
    """Bytes of every parameter and buffer (int8 weights and their scales included)."""
    tensors = [*model.parameters(), *model.buffers()]
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def memory_use(*drivers: object) -> MemoryUse:
    """The split for the drivers (one per served model) that report `memory_bytes()` (model,
    kv used, kv pool, device), added up; only the resident total for those that do not (the
    synthetic driver). `on_device` is the first driver's."""
    resident = psutil.Process().memory_info().rss
    model = used = pool = host_bytes = 0
    devices = []
    for driver in drivers:
        report = getattr(driver, "memory_bytes", None)
        m, u, p, device = report() if report is not None else (0, 0, 0, "cpu")
        model, used, pool = model + m, used + u, pool + p
        if device.split(":")[0] == "cpu":
            host_bytes += m + u
        devices.append(device)
    device = devices[0] if devices else "cpu"
    other = resident - host_bytes
    return MemoryUse(
        resident=resident / _MIB,
        model=model / _MIB,
        kv_used=used / _MIB,
        kv_pool=pool / _MIB,
        other=max(other, 0) / _MIB,
        on_device=device,
    )
