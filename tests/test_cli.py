"""The `pie` command as a user runs it: generate prints only the completion on stdout, the
event log it wrote can be printed and replayed, and a bad config is reported clearly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)


def pie(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pie.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
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
    assert "0 mismatches" in replayed.stdout and "pages free 64/64" in replayed.stdout


def test_a_config_with_an_unknown_key_is_refused_by_name(tmp_path: Path) -> None:
    config = tmp_path / "pie.toml"
    config.write_text("[kv]\npage_sise = 8\n", encoding="utf-8")
    done = pie("generate", "hi", "--config", str(config))
    assert done.returncode == 2
    assert "page_sise" in done.stderr and done.stdout == ""


def test_a_bad_config_value_is_refused_by_name(tmp_path: Path) -> None:
    config = tmp_path / "pie.toml"
    config.write_text('[model]\ndtype = "float8"\n', encoding="utf-8")
    done = pie("generate", "hi", "--config", str(config))
    assert done.returncode == 2
    assert "dtype" in done.stderr
