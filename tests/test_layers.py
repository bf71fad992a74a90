"""The import rules of pie's layers, read from the source: each package imports only the packages
below it, the sandbox reaches neither the actors nor the data plane, the client never loads the
server, the drivers or torch, and nothing but the entry point imports the command line."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1] / "pie"

ALLOWED = {
    "pie": set(),
    "pie.events": set(),
    "pie.durable": set(),
    "pie.build": {"pie"},
    "pie.net": set(),
    "pie.config": {"pie.net"},
    "pie.eventlog": {"pie.events"},
    "pie.wire": {"pie.events"},
    "pie.grammar": {"pie.events"},
    "pie.sandbox": {"pie.events", "pie.grammar"},
    "pie.drivers": {"pie.config", "pie.events", "pie.media"},
    "pie.media": {"pie.config"},
    "pie.dataplane": {"pie.drivers", "pie.events"},
    "pie.observe": {"pie.config", "pie.dataplane", "pie.events"},
    "pie.actors": {
        "pie",
        "pie.config",
        "pie.dataplane",
        "pie.durable",
        "pie.drivers",
        "pie.eventlog",
        "pie.events",
        "pie.net",
        "pie.observe",
        "pie.sandbox",
    },
    "pie.engine": {
        "pie",
        "pie.actors",
        "pie.config",
        "pie.dataplane",
        "pie.drivers",
        "pie.eventlog",
        "pie.events",
        "pie.grammar",
        "pie.net",
        "pie.observe",
        "pie.sandbox",
    },
    "pie.cluster": {"pie.actors", "pie.client", "pie.config", "pie.events"},
    "pie.server": {
        "pie",
        "pie.actors",
        "pie.build",
        "pie.cluster",
        "pie.config",
        "pie.dataplane",
        "pie.durable",
        "pie.engine",
        "pie.eventlog",
        "pie.events",
        "pie.observe",
        "pie.sandbox",
        "pie.wire",
    },
    "pie.client": {"pie.events", "pie.wire"},
}
"""Which of pie's packages each package may import (itself always). `pie.cli` may import
anything and is imported by nothing."""

THIRD_PARTY_BANNED = {
    "pie.client": {"torch", "wasmtime", "transformers"},
    "pie.wire": {"torch", "trio", "wasmtime"},
    "pie.events": {"torch", "trio", "wasmtime"},
    "pie.drivers": {"trio", "wasmtime"},
    "pie.dataplane": {"trio", "wasmtime"},
    "pie.media": {"trio", "wasmtime"},
    "pie.sandbox": {"torch", "trio"},
    "pie.grammar": {"torch", "trio", "wasmtime"},
    "pie.build": {"torch", "trio", "wasmtime"},
    "pie.cluster": {"torch", "wasmtime"},
}


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """Every absolute import in the file, wherever it stands (inside functions and
    TYPE_CHECKING blocks too: a lazy import is still a dependency)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno


def _violations(rule: dict[str, set[str]], third_party: bool) -> list[str]:
    found = []
    for module, path in _modules():
        source = _package(module)
        if source == "pie.cli" or source not in rule:
            continue
        for imported, line in _imports(path):
            target = _package(imported) if imported.startswith("pie") else imported.split(".")[0]
            if third_party == imported.startswith("pie"):
                continue
            if target != source and (target in rule[source]) == third_party:
                found.append(f"{path.relative_to(ROOT.parent)}:{line} imports {imported}")
    return found


def test_every_package_has_a_place_in_the_layers() -> None:
    packages = {_package(module) for module, _ in _modules()}
    assert packages - set(ALLOWED) == {"pie.cli"}


def test_each_package_imports_only_the_layers_below_it() -> None:
    assert _violations(ALLOWED, third_party=False) == []


def test_light_packages_never_import_heavy_libraries() -> None:
    assert _violations(THIRD_PARTY_BANNED, third_party=True) == []


def test_only_the_entry_point_imports_the_command_line() -> None:
    importers = [
        f"{path.relative_to(ROOT.parent)}:{line}"
        for module, path in _modules()
        if _package(module) != "pie.cli"
        for imported, line in _imports(path)
        if _package(imported) == "pie.cli"
    ]
    assert importers == []


def test_the_rules_catch_an_import_that_reaches_up(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from pie.dataplane.lanes import Lanes\n")
    assert ("pie.dataplane.lanes", 2) in list(_imports(source))
    assert _package("pie.dataplane.lanes") not in ALLOWED["pie.sandbox"]


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(done.stdout.split())


def test_the_client_and_its_commands_load_neither_torch_nor_the_server() -> None:
    loaded = _loaded_after("import pie.client, pie.cli.client, pie.build, pie.config")
    heavy = {m for m in loaded if m.split(".")[0] in ("torch", "wasmtime", "transformers")}
    engine_side = {m for m in loaded if _package(m) in ("pie.server", "pie.drivers", "pie.actors")}
    assert heavy == set() and engine_side == set()


def test_the_command_line_parser_loads_no_command() -> None:
    loaded = _loaded_after("import pie.cli; pie.cli.build_parser().parse_args(['list'])")
    assert {m for m in loaded if m.startswith("pie.")} <= {
        "pie.cli",
        "pie.cli.bench_parsers",
        "pie.cli.options",
        "pie.cli.parser",
    }


def test_an_engine_loads_the_mcp_and_model_conversion_stacks_only_when_used() -> None:
    loaded = _loaded_after("import pie.engine, pie.drivers.factory, pie.server")
    optional = {m.split(".")[0] for m in loaded} & {"mcp", "mcp_types", "transformers"}
    assert optional == set()
