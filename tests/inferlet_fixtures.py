"""Built inferlets for tests: each folder is built once and cached in pytest's cache folder under
the hash of everything that goes into it, so reruns skip the 7-second componentize-py build."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pie.build import cached_build

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "sdk" / "examples"
GUESTS = REPO / "tests" / "guests"


@pytest.fixture(scope="session")
def build_inferlet(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Path], Path]:
    """A function that builds an inferlet folder (or reuses its cached build) and returns the
    .wasm path, <pytest cache>/pie-inferlets/<folder name>-<digest>.wasm."""
    cache = getattr(pytestconfig, "cache", None)
    cache_dir = (
        tmp_path_factory.mktemp("pie-inferlets") if cache is None else cache.mkdir("pie-inferlets")
    )

    def build(folder: Path) -> Path:
        return cached_build(folder, Path(cache_dir))

    return build
