"""Every library pie imports at run time is declared in pyproject.toml, every declared version is
pinned exactly, and each pin is the one requirements.lock installs (the extras for hardware this
install does not have, `cuda`, are pinned but left out of the lock, the CPU install)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
HARDWARE_EXTRAS = {"cuda"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for line in requirements:
        name, sep, version = line.strip().partition("==")
        assert sep, f"{line!r} is not pinned with =="
        pins[_normal(name)] = version
    return pins


def _declared(*, hardware: bool = False) -> dict[str, str]:
    project = PYPROJECT["project"]
    extras = [
        r
        for name, group in project["optional-dependencies"].items()
        if hardware or name not in HARDWARE_EXTRAS
        for r in group
    ]
    return _pins([*project["dependencies"], *extras])


def _locked() -> dict[str, str]:
    lines = (ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines()
    return _pins([line for line in lines if line.strip() and not line.startswith("#")])


def _third_party_imports(folder: Path) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("pie", "__future__")}


def test_every_runtime_import_is_a_declared_dependency() -> None:
    runtime = {_normal(r.partition("==")[0]) for r in PYPROJECT["project"]["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    missing = {
        module: distributions.get(module)
        for module in _third_party_imports(ROOT / "pie")
        if not {_normal(d) for d in distributions.get(module, [])} & runtime
    }
    assert missing == {}


def test_hardware_extras_are_pinned_too() -> None:
    assert set(_declared(hardware=True)) > set(_declared())


def test_every_declared_pin_is_the_locked_one() -> None:
    locked = _locked()
    differing = {
        name: (version, locked.get(name))
        for name, version in _declared().items()
        if locked.get(name) != version
    }
    assert differing == {}


def test_the_installed_versions_are_the_declared_ones() -> None:
    # A local version label (torch's "+cpu") names the build, not the release.
    installed = {name: importlib.metadata.version(name).partition("+")[0] for name in _declared()}
    assert installed == _declared()
