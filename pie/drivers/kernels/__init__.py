"""pie's compiled CPU kernels (the 4-bit linear layer): built with torch's C++ extension tools on
first use into a cache folder keyed by the source, torch's version and the build flags, and
loaded from there by every later process without a compiler."""

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

__all__ = ["VARIANTS", "KernelBuildError", "build_q4", "q4_ops"]

SOURCE = Path(__file__).with_name("q4_linear.cpp")
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


@functools.cache
def q4_ops(variant: str = "native") -> Any:
    """The 4-bit ops (`linear`, `dequantize`, `isa`) of one build variant, built on first use."""
    return build_q4(variant, default_cache_dir() / "kernels")


def build_q4(variant: str, cache_dir: Path) -> Any:
    """Builds (unless cached) and loads one variant of the 4-bit kernel; its ops namespace.
    Once per process and variant: torch refuses a second library for the same namespace."""
    namespace = f"pie_q4_{variant}"
    flags = (*_FLAGS, *VARIANTS[variant], f"-DPIE_Q4_NAMESPACE={namespace}")
    folder = cache_dir / f"q4_linear-{variant}-{_key(flags)}"
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"{namespace}.so"
    # One process builds, the others wait for it, and the marker says the library is whole (the
    # lock file is not cpp_extension's own "lock", which it creates exclusively and waits on).
    with FileLock(str(folder / "pie-build.lock")):
        if not ((folder / _DONE).is_file() and library.is_file()):
            _compile(namespace, flags, folder)
            (folder / _DONE).write_text(str(library))
    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        raise KernelBuildError(f"cannot load pie's 4-bit kernel {library}: {e}") from e
    return getattr(torch.ops, namespace)


def _key(flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
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


def _compile(name: str, flags: tuple[str, ...], folder: Path) -> None:
    _check_toolchain()
    from torch.utils import cpp_extension

    started = time.perf_counter()
    print(f"pie: compiling the 4-bit CPU kernel into {folder} (first use)", file=sys.stderr)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=list(flags),
            build_directory=str(folder),
            is_python_module=False,
        )
    except Exception as e:  # cpp_extension raises bare RuntimeErrors and subprocess errors
        raise KernelBuildError(f"cannot compile pie's 4-bit CPU kernel: {e}") from e
    print(f"pie: compiled in {time.perf_counter() - started:.1f}s", file=sys.stderr)


def _check_toolchain() -> None:
    """Names the first missing piece: the C++ compiler, ninja, or torch's C++ headers."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(
            f"[model] weights = 'int4' compiles a small C++ kernel on first use, and the C++ "
            f"compiler {compiler!r} was not found (install g++, or set CXX to one)"
        )
    _put_ninja_on_path()
    from torch.utils.cpp_extension import include_paths

    headers = [Path(p) / "torch" / "library.h" for p in include_paths()]
    if not any(h.is_file() for h in headers):
        raise KernelBuildError(
            f"[model] weights = 'int4' compiles a small C++ kernel, and torch's C++ headers are "
            f"missing (looked for {headers[0]}): install a torch wheel that ships them"
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
            "[model] weights = 'int4' compiles a small C++ kernel with torch's builder, which "
            "needs ninja (pip install ninja)"
        ) from None
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
