"""pie's compiled CPU kernels: each C++ source here (SOURCES) is built with torch's C++
extension tools on first use into a cache folder keyed by the source, torch's version and the
build flags, and loaded from there by every later process without a compiler."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from pie.config import default_cache_dir

__all__ = ["SOURCES", "VARIANTS", "KernelBuildError", "build_kernels", "build_q4", "q4_ops"]

SOURCES: dict[str, tuple[str, str]] = {
    "q4": ("q4_linear.cpp", "the 4-bit CPU kernel"),
    "layer": ("layer_ops.cpp", "the fused CPU layer kernels"),
    "attention": ("decode_attention.cpp", "the CPU paged decode attention kernel"),
}
"""Kernel library -> (its C++ source beside this file, what to call it in messages). A source
registers its ops under the namespace the build passes as PIE_KERNEL_NAMESPACE."""
VARIANTS: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    # The same machine with its AVX-512 switched off (what most CI runners have) and with no AVX
    # at all (the portable loop): both paths stay compiled and tested on any x86 machine.
    "avx2": ("-march=native", "-mno-avx512f"),
    "portable": ("-march=native", "-mno-avx"),
}
_FLAGS = ("-O3",)
_DONE = "built"


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled or loaded; the message says what is missing."""


def q4_ops(variant: str = "native") -> Any:
    """The block-weight ops (`linear`, `dequantize`, their Q8_0 forms `linear8`, `dequantize8`,
    `rows8`, and `isa`) of one build variant, built on first use."""
    return kernel_ops("q4", variant)


def build_q4(variant: str, cache_dir: Path) -> Any:
    return build_kernels("q4", variant, cache_dir)


def kernel_ops(library: str, variant: str = "native") -> Any:
    """The ops namespace of one kernel library (a key of SOURCES), built on first use."""
    return _cached_ops(library, variant)


@functools.cache
def _cached_ops(library: str, variant: str) -> Any:
    return build_kernels(library, variant, default_cache_dir() / "kernels")


_LOADED: dict[str, Path] = {}
"""Namespace -> the library file this process loaded it from."""


def _check_not_loaded(namespace: str, library_file: Path, what: str) -> None:
    """torch aborts the process when a second library registers a namespace already loaded:
    refuse another build of a loaded kernel (its source changed since this process loaded it)."""
    loaded = _LOADED.get(namespace)
    if loaded is not None and loaded != library_file:
        raise KernelBuildError(
            f"pie's {what} was loaded from {loaded} and a different build {library_file} was "
            f"asked for (its source or cache folder changed): restart the process to use it"
        )


def build_kernels(library: str, variant: str, cache_dir: Path) -> Any:
    """Builds (unless cached) and loads one variant of a kernel library; its ops namespace.
    Once per process and variant: torch refuses a second library for the same namespace."""
    source = Path(__file__).with_name(SOURCES[library][0])
    namespace = f"pie_{library}_{variant}"
    flags = (*_FLAGS, *VARIANTS[variant], f"-DPIE_KERNEL_NAMESPACE={namespace}")
    folder = cache_dir / f"{source.stem}-{variant}-{_key(source, flags)}"
    folder.mkdir(parents=True, exist_ok=True)
    library_file = folder / f"{namespace}.so"
    # One process builds, the others wait for it, and the marker says the library is whole (the
    # lock file is not cpp_extension's own "lock", which it creates exclusively and waits on).
    with FileLock(str(folder / "pie-build.lock")):
        if not ((folder / _DONE).is_file() and library_file.is_file()):
            _compile(library, namespace, source, flags, folder)
            (folder / _DONE).write_text(str(library_file))
    _check_not_loaded(namespace, library_file, SOURCES[library][1])
    try:
        torch.ops.load_library(str(library_file))
        _LOADED[namespace] = library_file
    except OSError as e:
        raise KernelBuildError(
            f"cannot load pie's {SOURCES[library][1]} {library_file}: {e}"
        ) from e
    return getattr(torch.ops, namespace)


def _key(source: Path, flags: tuple[str, ...]) -> str:
    """The build's cache key: the source, the headers beside it (any source may include them),
    torch's version, the CPU and the flags."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(b"\0" + header.name.encode() + b"\0" + header.read_bytes())
    digest.update("\0".join((torch.__version__, _cpu(), *flags)).encode())
    return digest.hexdigest()[:16]


def _cpu() -> str:
    """What -march=native compiles for: a cache shared between machines (a network home, an
    image built elsewhere) must not hand one CPU's instructions to another."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return f"{platform.system()} {platform.machine()} {platform.processor()}"


def _compile(library: str, name: str, source: Path, flags: tuple[str, ...], folder: Path) -> None:
    _check_toolchain()
    from torch.utils import cpp_extension

    what = SOURCES[library][1]
    # cpp_extension loads what it builds.
    _check_not_loaded(name, folder / f"{name}.so", what)
    started = time.perf_counter()
    print(f"pie: compiling {what} into {folder} (first use)", file=sys.stderr)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=list(flags),
            build_directory=str(folder),
            is_python_module=False,
        )
    except Exception as e:  # cpp_extension raises bare RuntimeErrors and subprocess errors
        raise KernelBuildError(f"cannot compile pie's {what}: {e}") from e
    print(f"pie: compiled in {time.perf_counter() - started:.1f}s", file=sys.stderr)


def _check_toolchain() -> None:
    """Names the first missing piece: the C++ compiler, ninja, or torch's C++ headers."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(
            f"pie's CPU kernels (int4 weights, fused layer operations) are compiled from C++ on "
            f"first use, and the C++ compiler {compiler!r} was not found (install g++, or set "
            f"CXX to one)"
        )
    _put_ninja_on_path()
    from torch.utils.cpp_extension import include_paths

    headers = [Path(p) / "torch" / "library.h" for p in include_paths()]
    if not any(h.is_file() for h in headers):
        raise KernelBuildError(
            f"pie's CPU kernels are compiled from C++, and torch's C++ headers are missing "
            f"(looked for {headers[0]}): install a torch wheel that ships them"
        )


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the PyPI package's binary sits beside the
    interpreter, which is not on PATH when pie runs from an unactivated virtual environment."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        raise KernelBuildError(
            "pie's CPU kernels are compiled with torch's builder, which needs ninja "
            "(pip install ninja)"
        ) from None
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
