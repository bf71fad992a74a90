"""The instruction-set variants of pie's compiled CPU kernels that the kernel tests run on this
machine: native always, and on x86 the AVX2 build (where the CPU has AVX2) and the portable one."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

X86 = platform.machine() in ("x86_64", "AMD64")
_CPUINFO = Path("/proc/cpuinfo")
_FLAGS = _CPUINFO.read_text() if _CPUINFO.exists() else ""
RUNS_AVX2 = X86 and " avx2" in _FLAGS
BUILT = ["native", *(["avx2"] if RUNS_AVX2 else []), *(["portable"] if X86 else [])]
"""The variants the kernel tests build here."""
VARIANTS = [
    "native",
    pytest.param("avx2", marks=pytest.mark.skipif(not RUNS_AVX2, reason="no AVX2")),
    pytest.param("portable", marks=pytest.mark.skipif(not X86, reason="x86 flags")),
]
