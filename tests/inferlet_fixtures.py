"""Built inferlets for tests: each folder is built once and cached in pytest's cache folder under
the hash of everything that goes into it, so reruns skip the 7-second componentize-py build."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from pie.build import GUEST_SDK, WIT_DIR
from pie.build import build_inferlet as _build

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "sdk" / "examples"
GUESTS = REPO / "tests" / "guests"


def inputs_digest(folder: Path) -> str:
    """sha256 over the folder's files, the guest SDK and the WIT (paths and contents)."""
    digest = hashlib.sha256()
    for root in (folder, GUEST_SDK, WIT_DIR):
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
        digest.update(b"\1")
    return digest.hexdigest()


@pytest.fixture(scope="session")
def build_inferlet(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Path], Path]:
    """A function that builds an inferlet folder (or reuses its cached build) and returns the
    .wasm path, under <pytest cache>/pie-inferlets/<digest>.wasm."""
    cache = getattr(pytestconfig, "cache", None)
    cache_dir = (
        tmp_path_factory.mktemp("pie-inferlets") if cache is None else cache.mkdir("pie-inferlets")
    )

    def build(folder: Path) -> Path:
        output = Path(cache_dir) / f"{inputs_digest(folder)}.wasm"
        if not output.is_file():
            _build(folder, output)
        return output

    return build
