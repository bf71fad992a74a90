"""Built inferlets for tests: each folder is built once and cached in pytest's cache folder under
the hash of everything that goes into it, so reruns skip the 7-second componentize-py build."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from attrs import frozen

from pie.build import cached_build
from pie.sandbox import WasmRuntime

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


@frozen
class CompiledGuest:
    """A test guest's component, and a component cache that already holds it compiled."""

    wasm: bytes
    components: Path


def compile_guest(
    build: Callable[[Path], Path], tmp_path_factory: pytest.TempPathFactory, folder: Path
) -> CompiledGuest:
    """Builds and compiles a guest once (for a module-scoped fixture), so that no test's time
    limit pays for the compile."""
    wasm = build(folder).read_bytes()
    components = tmp_path_factory.mktemp("components")
    WasmRuntime(components).cache.load(wasm)
    return CompiledGuest(wasm, components)


async def run_json(engine: Any, program: str, request: dict[str, Any], seconds: float = 600) -> Any:
    """Runs an installed program (by hash) with `request` as its JSON input; its JSON result.
    A program that does not return fails the test with its error."""
    with trio.fail_after(seconds):
        outcome = await engine.run_inferlet(program, json.dumps(request))
    assert outcome.ok, outcome.error
    return json.loads(outcome.result)
