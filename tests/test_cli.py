"""The `pie` command as a user runs it: generate and run print only the result on stdout, the
event log it wrote can be printed and replayed, and a bad config is reported clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.inferlet_fixtures import EXAMPLES, GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import components_dir, default_model_dir  # noqa: F401  (fixture)


def pie(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pie.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.model
def test_generate_log_and_replay(tmp_path: Path, default_model_dir: Path) -> None:  # noqa: F811
    log_path = tmp_path / "events.jsonl"
    config = tmp_path / "pie.toml"
    config.write_text(f'[event_log]\npath = "{log_path}"\n[kv]\nnum_pages = 64\n', encoding="utf-8")
    done = pie(
        "generate",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--model",
        str(default_model_dir),
        "--config",
        str(config),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "The capital of France is Paris.\n"
    assert "generated" in done.stderr

    shown = pie("log", str(log_path), "--actor", "kv", "--limit", "3")
    assert shown.returncode == 0
    lines = shown.stdout.splitlines()
    assert len(lines) == 3 and "EngineStarted" not in shown.stdout
    assert "CreateContext" in lines[0]

    replayed = pie("replay", str(log_path))
    assert replayed.returncode == 0, replayed.stdout
    assert "kv: replayed" in replayed.stdout and "pages free 64/64" in replayed.stdout
    assert replayed.stdout.count(": exact") == 4, replayed.stdout


@pytest.mark.integration
def test_a_config_with_an_unknown_key_is_refused_by_name(tmp_path: Path) -> None:
    config = tmp_path / "pie.toml"
    config.write_text("[kv]\npage_sise = 8\n", encoding="utf-8")
    done = pie("generate", "hi", "--config", str(config))
    assert done.returncode == 2
    assert "page_sise" in done.stderr and done.stdout == ""


@pytest.mark.integration
def test_a_bad_config_value_is_refused_by_name(tmp_path: Path) -> None:
    config = tmp_path / "pie.toml"
    config.write_text('[model]\ndtype = "float8"\n', encoding="utf-8")
    done = pie("generate", "hi", "--config", str(config))
    assert done.returncode == 2
    assert "dtype" in done.stderr


def run_config(tmp_path: Path, pytestconfig: pytest.Config) -> Path:
    """Few KV pages, and compiled components kept in pytest's cache between runs."""
    components = components_dir(pytestconfig) or tmp_path
    config = tmp_path / "pie.toml"
    config.write_text(
        f'[kv]\nnum_pages = 64\n[sandbox]\ncache_dir = "{components}"\n', encoding="utf-8"
    )
    return config


@pytest.mark.model
def test_run_prints_only_the_inferlets_result(
    tmp_path: Path,
    pytestconfig: pytest.Config,
    default_model_dir: Path,  # noqa: F811
    built: Callable[[Path], Path],  # noqa: F811
) -> None:
    wasm = built(EXAMPLES / "text-completion")
    request = {"prompt": "What is the capital of France?", "max_tokens": 16, "temperature": 0}
    done = pie(
        "run",
        str(wasm),
        "--input",
        json.dumps(request),
        "--model",
        str(default_model_dir),
        "--config",
        str(run_config(tmp_path, pytestconfig)),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "The capital of France is Paris.\n"


@pytest.mark.model
def test_run_reports_a_failing_inferlet_on_stderr(
    tmp_path: Path,
    pytestconfig: pytest.Config,
    default_model_dir: Path,  # noqa: F811
    built: Callable[[Path], Path],  # noqa: F811
) -> None:
    wasm = built(GUESTS / "misbehave")
    done = pie(
        "run",
        str(wasm),
        "--input",
        '{"mode": "raise"}',
        "--model",
        str(default_model_dir),
        "--config",
        str(run_config(tmp_path, pytestconfig)),
    )
    assert done.returncode == 1 and done.stdout == ""
    assert "failed" in done.stderr and "ValueError: boom" in done.stderr


@pytest.mark.integration
def test_run_names_a_missing_component(tmp_path: Path) -> None:
    done = pie("run", str(tmp_path / "nowhere.wasm"))
    assert done.returncode == 2 and "nowhere.wasm" in done.stderr and done.stdout == ""


@pytest.mark.integration
def test_doctor_names_the_driver_and_why() -> None:
    done = pie("doctor", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {"torch", "cuda_available", "driver", "reason"} <= set(report)
    if not report["cuda_available"]:
        assert report["driver"] == "torch" and "not a CUDA GPU" in report["reason"]
    on_cpu = pie("doctor", "--device", "cpu", "--dtype", "bfloat16")
    assert on_cpu.returncode == 0 and "driver: torch" in on_cpu.stdout
    assert "the device is cpu" in on_cpu.stdout
