"""`[driver] threads` and `omp_wait_policy`: the defaults, refusals of bad values, and an engine
that loads its model with them (in a child process, so this one's torch is left as it is)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pie.config import ConfigError, DriverConfig, config_from_dict
from pie.drivers import threads
from pie.drivers.threads import WAIT_POLICY, set_wait_policy, thread_count, usable_cores
from tests.tiny_models import TINY_CASES, save_tiny_model


@pytest.mark.unit
def test_the_default_leaves_one_usable_core_to_the_rest_of_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = config_from_dict({}).driver
    assert config == DriverConfig(threads=0, omp_wait_policy="passive")
    assert thread_count(config) == max(1, usable_cores() - 1)
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert thread_count(config) == 7
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert thread_count(config) == 1


@pytest.mark.unit
def test_usable_cores_are_those_the_process_may_run_on() -> None:
    assert usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.unit
def test_an_explicit_thread_count_is_kept() -> None:
    config = config_from_dict({"driver": {"threads": 3, "omp_wait_policy": "active"}}).driver
    assert (thread_count(config), config.omp_wait_policy) == (3, "active")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("driver", "words"),
    [
        ({"threads": -1}, "threads must be >= 0, got -1"),
        ({"threads": 2.5}, "[driver] threads: expected an integer, got 2.5"),
        ({"threads": "2"}, "expected an integer, got '2'"),
        ({"threads": "auto"}, "expected an integer, got 'auto'"),
        ({"threads": True}, "expected an integer, got True"),
        ({"omp_wait_policy": "spin"}, "omp_wait_policy must be one of passive, active"),
        ({"thread": 2}, "[driver] has no key 'thread'; did you mean 'threads'?"),
    ],
)
def test_bad_driver_values_are_refused_saying_why(driver: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"driver": driver})
    assert words in str(refused.value)


@pytest.mark.unit
def test_the_wait_policy_goes_into_the_environment_before_torch_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    set_wait_policy(DriverConfig(omp_wait_policy="active"))
    assert os.environ[WAIT_POLICY] == "ACTIVE"


@pytest.mark.unit
def test_the_users_wait_policy_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WAIT_POLICY, "active")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    set_wait_policy(DriverConfig())
    assert os.environ[WAIT_POLICY] == "active"


@pytest.mark.unit
def test_once_torch_is_loaded_the_environment_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch", sys))
    set_wait_policy(DriverConfig())
    assert WAIT_POLICY not in os.environ


ENGINE_IN_A_CHILD = """
import json, sys, threading
import trio
from pie.config import config_from_dict
from pie.engine import open_engine

torch_before = "torch" in sys.modules
model, cache, driver = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = config_from_dict(
    {"model": {"path": model}, "driver": driver, "kv": {"num_pages": 8},
     "sandbox": {"cache_dir": cache}}
)

async def main():
    async with open_engine(config) as engine:
        return engine.info.threads

info_threads = trio.run(main)
import os, torch
elsewhere = []
thread = threading.Thread(target=lambda: elsewhere.append(torch.get_num_threads()))
thread.start()
thread.join()
print(json.dumps({
    "torch_before": torch_before, "policy": os.environ.get("OMP_WAIT_POLICY"),
    "info": info_threads, "here": torch.get_num_threads(), "elsewhere": elsewhere[0],
}))
"""


@pytest.mark.integration
@pytest.mark.parametrize(
    ("driver", "users_policy", "threads_", "policy"),
    [
        ({"threads": 1, "omp_wait_policy": "active"}, None, 1, "ACTIVE"),
        ({"threads": 2}, "passive", 2, "passive"),
    ],
)
def test_an_engine_on_the_torch_driver_computes_with_the_configured_threads(
    tmp_path: Path,
    driver: dict[str, object],
    users_policy: str | None,
    threads_: int,
    policy: str,
) -> None:
    save_tiny_model(tmp_path / "model", TINY_CASES["llama-linear-rope-tied"])
    env = {k: v for k, v in os.environ.items() if k != WAIT_POLICY}
    if users_policy:
        env[WAIT_POLICY] = users_policy
    args = [str(tmp_path / "model"), str(tmp_path / "components"), json.dumps(driver)]
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_IN_A_CHILD, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    # The policy only counts when it is set before torch loads, which open_engine does.
    assert seen == {
        "torch_before": False,
        "policy": policy,
        "info": threads_,
        "here": threads_,
        "elsewhere": threads_,
    }
    assert f"{threads_} CPU thread" in done.stderr
