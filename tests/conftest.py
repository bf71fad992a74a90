"""Test plumbing: `async def` tests run under trio.run (trio's own test helper), and every test
carries exactly one tier marker (docs/development.md#tests)."""

from __future__ import annotations

import atexit
import inspect
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio.testing

from tests.model_fixtures import (  # noqa: F401  (fixtures for every module)
    default_model_dir,
    real,
    tokenizer,
)

TIERS = ("unit", "integration", "model", "security")
REAL_MODEL_FIXTURES = frozenset({"real", "default_model_dir", "tokenizer", "default_gguf"})


def pytest_sessionstart(session: pytest.Session) -> None:
    """Builds pie's compiled CPU kernels, in every variant the kernel tests use, before any test
    runs, so that no test with a deadline pays for a first compile (seconds each on a small
    machine; cached afterwards). The builds run in child processes, two at a time; this process
    then loads the native ones."""
    from pie.drivers.kernels import SOURCES, KernelBuildError, kernel_ops
    from tests.kernel_variants import BUILT

    script = "import sys; from pie.drivers.kernels import kernel_ops; kernel_ops(*sys.argv[1:])"
    waiting = [[sys.executable, "-c", script, lib, variant] for lib in SOURCES for variant in BUILT]
    running: list[subprocess.Popen[bytes]] = []
    while waiting or running:
        while waiting and len(running) < 2:
            quiet = subprocess.DEVNULL
            running.append(subprocess.Popen(waiting.pop(0), stdout=quiet, stderr=quiet))
        running.pop(0).wait()
    for library in SOURCES:
        try:
            kernel_ops(library)
        except KernelBuildError:
            pass  # the tests that need a kernel say why it is missing
    from tests.compile_memo import install

    cache = getattr(session.config, "cache", None)
    if cache is not None:
        install(Path(cache.mkdir("pie-compiled")))
    else:  # kept for this run only: compiled components are tens of megabytes each
        folder = Path(tempfile.mkdtemp("-pie-compiled"))
        install(folder)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    trio.testing.trio_test(pyfuncitem.obj)(**kwargs)
    return True


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    problems = [problem for item in items if (problem := tier_problem(item))]
    if problems:
        raise pytest.UsageError(
            "tests need exactly one tier marker, "
            + ", ".join(f"@pytest.mark.{tier}" for tier in TIERS)
            + " (docs/development.md#tests):\n  "
            + "\n  ".join(problems)
        )


def tier_problem(item: pytest.Item) -> str | None:
    """What is wrong with the test's tier, or None."""
    tiers = [mark.name for mark in item.iter_markers() if mark.name in TIERS]
    if not tiers:
        return f"{item.nodeid}: no tier marker"
    if len(tiers) > 1:
        return f"{item.nodeid}: {len(tiers)} tier markers ({', '.join(tiers)})"
    model = sorted(REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())))
    if tiers == ["unit"] and model:
        return f"{item.nodeid}: a unit test that needs the real model (fixtures {', '.join(model)})"
    return None
