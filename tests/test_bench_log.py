"""`pie bench log` runs every setting of the event log in its own engine and reports each one's
rate and its ratio to the log off."""

from __future__ import annotations

import json

import pytest

from pie.cli import main


@pytest.mark.model
def test_the_log_bench_reports_every_setting_against_the_log_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "log", "--tokens", "128", "--concurrency", "2", "--repeats", "2", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["concurrency"] == 2
    for name in ("off", "ring", "file", "record"):
        tps = result[name]["tps"]
        assert 0 < tps["min"] <= tps["median"] <= tps["max"]
        assert result[name]["host_us_per_token"]["median"] > 0
    for name in ("ring", "file", "record"):
        assert result[name]["of_off"]["median"] > 0 and result[name]["cpu_of_off"]["median"] > 0
    assert "of_off" not in result["off"] and "cpu_of_off" not in result["off"]
