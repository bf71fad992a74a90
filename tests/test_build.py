"""`pie build`: folders that are not inferlets are refused with the file, line and reason before
componentize-py runs; a real build makes a component wasmtime compiles."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import wasmtime
from wasmtime.component import Component

from pie.build import BuildError, build_inferlet, component
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)

GOOD_MAIN = "async def main(input):\n    return 'ok'\n"


@pytest.fixture(autouse=True)
def no_compiler(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checks must fail before componentize-py is started (except in the real build)."""
    if "real_build" not in request.node.name:

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("componentize-py was started")

        monkeypatch.setattr(component, "_componentize", refuse)


def inferlet(tmp_path: Path, files: dict[str, str]) -> Path:
    folder = tmp_path / "app"
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def refusal(folder: Path) -> str:
    with pytest.raises(BuildError) as caught:
        build_inferlet(folder, folder.parent / "out.wasm")
    assert not (folder.parent / "out.wasm").exists()
    return str(caught.value)


@pytest.mark.unit
def test_a_missing_folder_is_named(tmp_path: Path) -> None:
    assert "no such folder" in refusal(tmp_path / "nowhere")


@pytest.mark.unit
def test_a_folder_without_main_py_is_refused(tmp_path: Path) -> None:
    message = refusal(inferlet(tmp_path, {"helper.py": "x = 1\n"}))
    assert "no main.py" in message


@pytest.mark.unit
def test_a_syntax_error_in_any_file_is_reported_with_file_and_line(tmp_path: Path) -> None:
    folder = inferlet(tmp_path, {"main.py": GOOD_MAIN, "lib/util.py": "x = 1\ndef f(:\n"})
    message = refusal(folder)
    assert f"{folder / 'lib' / 'util.py'}:2" in message and "syntax error" in message


@pytest.mark.unit
def test_main_must_be_an_async_function(tmp_path: Path) -> None:
    folder = inferlet(tmp_path, {"main.py": "\n\ndef main(input):\n    return 1\n"})
    message = refusal(folder)
    assert f"{folder / 'main.py'}:3" in message and "async def main" in message


@pytest.mark.unit
def test_main_py_must_define_main(tmp_path: Path) -> None:
    message = refusal(inferlet(tmp_path, {"main.py": "async def start(input):\n    pass\n"}))
    assert "no `main` function" in message


@pytest.mark.integration
def test_the_cli_prints_the_reason_and_fails(tmp_path: Path) -> None:
    folder = inferlet(tmp_path, {"main.py": "def main(:\n"})
    done = subprocess.run(
        [sys.executable, "-m", "pie.cli", "build", str(folder), "-o", str(tmp_path / "x.wasm")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert f"{folder / 'main.py'}:1" in done.stderr


@pytest.mark.integration
def test_real_build_makes_a_component_wasmtime_compiles(
    built: Callable[[Path], Path],  # noqa: F811
) -> None:
    wasm = built(GUESTS / "misbehave")
    component = Component(wasmtime.Engine(), wasm.read_bytes())
    assert component.get_export_index("run") is not None


@pytest.mark.integration
def test_real_build_reports_componentize_py_errors(tmp_path: Path) -> None:
    folder = inferlet(tmp_path, {"main.py": "import no_such_module\n\n" + GOOD_MAIN})
    message = refusal(folder)
    assert "componentize-py failed" in message and "no_such_module" in message
