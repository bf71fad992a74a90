"""`pie doctor`: what this machine offers the engine: the device, torch, CUDA and flashinfer
versions, the driver the configured engine would pick and why, and whether the CUDA driver's
kernels load and run (on a GPU)."""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

from pie.cli.options import engine_config


def _device() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = props.name
        facts["compute_capability"] = f"{props.major}.{props.minor}"
        facts["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return facts


def check_kernels(kernels: Any, head_dims: tuple[int, ...] = (64, 128)) -> dict[str, str]:
    """Runs a paged decode and a causal prefill of each head size on the GPU; what happened to
    each, with the seconds it took (the first call loads or compiles the kernel)."""
    import torch

    from pie.drivers.kvcache import KvCacheShape, PagedKvCache
    from pie.drivers.paged_kernels import PagedKernels
    from pie.drivers.paged_plan import GroupKind, PagedGroup

    results: dict[str, str] = {}
    for head_dim in head_dims:
        shape = KvCacheShape(
            num_layers=1, page_size=16, num_kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16
        )
        cache = PagedKvCache(shape, 4, "cuda")
        paged = PagedKernels(kernels, cache, num_heads=8, device=torch.device("cuda"))
        for kind, tokens in ((GroupKind.DECODE, 1), (GroupKind.CAUSAL, 8), (GroupKind.CUSTOM, 8)):
            group = PagedGroup(kind=kind, tokens=list(range(tokens)), qo_indptr=[0, tokens])
            group.kv_indptr, group.kv_indices, group.last_page_len = [0, 2], [0, 1], [4]
            if kind is GroupKind.CUSTOM:
                group.masks = [torch.arange(tokens * 20).view(tokens, 20) % 3 != 1]
            started = time.perf_counter()
            try:
                wrapper = paged.plan_group(group)
                q = torch.randn(tokens, 8, head_dim, dtype=torch.bfloat16, device="cuda")
                out = wrapper.run(q, cache.layer(0))
                torch.cuda.synchronize()
                ok = bool(torch.isfinite(out).all())
                verdict = "ok" if ok else "ran, but gave non-finite values"
                results[f"{kind.value} head_dim {head_dim}"] = (
                    f"{verdict} ({time.perf_counter() - started:.2f} s)"
                )
            except Exception as err:  # report every failure rather than stop at the first
                results[f"{kind.value} head_dim {head_dim}"] = (
                    f"failed: {type(err).__name__}: {err}"
                )
    return results


def run_doctor(args: argparse.Namespace) -> int:
    from pie.drivers.select import choose_driver, load_flashinfer

    report: dict[str, Any] = _device()
    module, version = load_flashinfer() if report["cuda_available"] else (None, "not checked")
    report["flashinfer"] = version if module is not None else None
    if module is None:
        report["flashinfer_problem"] = version
    try:
        choice = choose_driver(engine_config(args))
        report["driver"], report["device"] = choice.driver, choice.device
        report["dtype"], report["reason"] = str(choice.dtype).removeprefix("torch."), choice.reason
    except RuntimeError as err:
        report["driver"], report["reason"] = None, str(err)
    healthy = report["driver"] is not None
    if report["driver"] == "cuda":
        report["kernels"] = check_kernels(module)
        healthy = all(v.startswith("ok") for v in report["kernels"].values())
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            if isinstance(value, dict):
                for name, verdict in value.items():
                    print(f"{key}: {name}: {verdict}")
            else:
                print(f"{key}: {value}")
    return 0 if healthy else 1
