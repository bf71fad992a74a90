"""Turns a checked inferlet folder into a WebAssembly component with componentize-py, against
sdk/wit and the guest SDK in sdk/python, and caches builds by the digest of their inputs."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pie
from pie.build.check import WORLDS, BuildError, check_inferlet

SDK = Path(pie.__file__).resolve().parents[1] / "sdk"
WIT_DIR = SDK / "wit"
GUEST_SDK = SDK / "python"


def build_inferlet(folder: Path, output: Path) -> None:
    """Builds `folder` (which holds main.py with `async def main(input)`, or `async def
    handle(request)` for an HTTP-served inferlet) into `output`."""
    folder = Path(folder)
    entry = check_inferlet(folder)
    output = Path(output).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    # Writing next to the output and renaming keeps a failed build from leaving a partial file.
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=".pie-build-") as scratch:
        partial = Path(scratch) / output.name
        _componentize(folder.resolve(), partial, entry)
        os.replace(partial, output)


def _componentize(folder: Path, output: Path, entry: str) -> None:
    world, module = WORLDS[entry]
    command = [
        *_componentize_py(),
        "-d",
        str(WIT_DIR),
        "-w",
        world,
        "componentize",
        module,
        "-p",
        str(folder),
        "-p",
        str(GUEST_SDK),
        "-o",
        str(output),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=folder)
    except OSError as err:
        raise BuildError(f"cannot run componentize-py: {err}") from None
    if done.returncode != 0 or not output.is_file():
        detail = (done.stderr or done.stdout).strip()
        raise BuildError(f"componentize-py failed for {folder}:\n{detail}")


# The package has no `__main__`, so call its console entry point from this Python.
_LAUNCHER = "import sys; from componentize_py import script; sys.exit(script())"


def _componentize_py() -> list[str]:
    return [sys.executable, "-c", _LAUNCHER]


def inputs_digest(folder: Path) -> str:
    """sha256 over everything a build of `folder` reads: its files, the guest SDK and the WIT."""
    digest = hashlib.sha256()
    for root in (folder, GUEST_SDK, WIT_DIR):
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
        digest.update(b"\1")
    return digest.hexdigest()


def cached_build(folder: Path, cache_dir: Path) -> Path:
    """`folder` built into cache_dir/<name>-<inputs digest>.wasm, reusing an earlier build of
    the same inputs; builds of older inputs are deleted."""
    folder = Path(folder)
    output = Path(cache_dir) / f"{folder.name}-{inputs_digest(folder)}.wasm"
    if not output.is_file():
        for stale in Path(cache_dir).glob(f"{folder.name}-*"):
            stale.unlink()
        build_inferlet(folder, output)
    return output
