"""Tensor parallelism on the default model (SmolLM2-135M, 9 query / 3 KV heads): two gloo ranks
give one rank's greedy tokens and, within 1e-3, its logits (measured: at most 3.1e-5 on logits
up to 38), through the driver and through the whole engine; the ranks listen on loopback only;
no rank outlives rank 0, stopped or killed; a rank that cannot start is named; and the settings
that cannot shard are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from pie.actors.generate import generate
from pie.cli import build_parser
from pie.cli.options import engine_config
from pie.config import ConfigError, config_from_dict
from pie.drivers.batch import ForwardBatch
from pie.drivers.factory import build_driver, build_rank, build_torch_driver
from pie.drivers.select import DriverChoice
from pie.drivers.tp_ranks import RankStartError, start_ranks
from pie.engine import open_engine
from pie.events.sampling import Argmax, RawLogits
from tests.tiny_models import save_tiny_model

TOKENS = 32
LOGIT_TOLERANCE = 1e-3
PROMPT = "The capital of France is"


def _config(ranks: int, **model: Any) -> Any:
    return config_from_dict(
        {
            "model": {"dtype": "float32", "device": "cpu", "tensor_parallel": ranks, **model},
            "kv": {"num_pages": 8},
        }
    )


def _pass(tokens: list[int], start: int) -> ForwardBatch:
    """One request on pages 0-3 whose last token is read twice: greedy and raw logits."""
    n = len(tokens)
    return ForwardBatch(
        token_ids=tokens,
        positions=list(range(start, start + n)),
        qo_indptr=[0, n],
        kv_page_indptr=[0, 4],
        kv_page_indices=[0, 1, 2, 3],
        kv_lens=[start + n],
        masked_pages=[()],
        attention_masks=[None],
        logit_masks=[None],
        logit_biases=[()],
        penalties=[None],
        adapters=[None],
        slot_requests=[0, 0],
        slot_tokens=[n - 1, n - 1],
        slot_ops=[Argmax(), RawLogits()],
    )


def _greedy(driver: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """TOKENS greedy tokens after `prompt` and the logits each was picked from."""
    tokens: list[int] = []
    logits = []
    batch, position = _pass(prompt, 0), len(prompt)
    while len(tokens) < TOKENS:
        picked, raw = driver.forward(batch)
        tokens.append(picked.token)
        logits.append(torch.tensor(raw.values))
        batch, position = _pass([picked.token], position), position + 1
    return tokens, torch.stack(logits)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the sockets that `pids`
    listen on."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(fields[1].split(":")[0])
    return found


@pytest.fixture(scope="module")
def one_rank() -> tuple[list[int], list[int], torch.Tensor]:
    """The prompt, and one rank's greedy tokens and logits on the default model."""
    driver, tokenizer = build_driver(_config(1, weights="dtype"))
    prompt = tokenizer.encode(PROMPT)
    return (prompt, *_greedy(driver, prompt))


@pytest.mark.model
def test_two_gloo_ranks_give_one_ranks_greedy_tokens_and_logits(one_rank: Any) -> None:
    prompt, tokens, logits = one_rank
    driver, _ = build_driver(_config(2))
    rank_pids = [p.pid for p in driver.group.processes]
    try:
        assert driver.info.num_pages == 8
        # Only loopback: 127.0.0.1 in /proc/net/tcp's byte order.
        assert _listening_addresses([os.getpid(), *rank_pids]) <= {"0100007F"}
        sharded_tokens, sharded_logits = _greedy(driver, prompt)
    finally:
        driver.close()
    assert sharded_tokens == tokens
    assert (sharded_logits - logits).abs().max().item() < LOGIT_TOLERANCE
    assert all(_gone(pid, 1.0) for pid in rank_pids)


@pytest.mark.model
def test_the_engine_on_two_ranks_generates_one_ranks_tokens(one_rank: Any) -> None:
    prompt, tokens, _ = one_rank

    async def main() -> list[int]:
        with trio.fail_after(90):
            async with open_engine(_config(2)) as engine:
                driver = engine.models[0].driver
                pids.extend(p.pid for p in driver.group.processes)
                folder.append(driver.group.folder)
                async with engine.requester() as requester:
                    done = await generate(requester, prompt, max_tokens=TOKENS, sampler=Argmax())
        return list(done.tokens)

    pids: list[int] = []
    folder: list[str] = []
    assert trio.run(main) == tokens
    assert pids and all(_gone(pid, 1.0) for pid in pids)
    assert not Path(folder[0]).exists()


RANK_0 = """
import sys, time
from pie.config import config_from_dict
from pie.drivers.factory import build_driver
config = config_from_dict({"model": {"dtype": "float32", "device": "cpu", "path": sys.argv[1],
                                     "tensor_parallel": 2}, "kv": {"num_pages": 8}})
driver, _ = build_driver(config)
print(driver.group.folder, *(p.pid for p in driver.group.processes), flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_model(folder, dict(model_type="llama", num_key_value_heads=2))
    return folder


@pytest.mark.model
def test_ranks_exit_when_rank_0_is_killed(tiny_llama: Path) -> None:
    rank_0 = subprocess.Popen(
        [sys.executable, "-c", RANK_0, str(tiny_llama)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert rank_0.stdout is not None
        folder, *pids = rank_0.stdout.readline().split()
        assert len(pids) == 1 and not _gone(int(pids[0]), 0.2)
        assert Path(folder).is_dir()
    finally:
        rank_0.send_signal(signal.SIGKILL)
        rank_0.wait()
    assert _gone(int(pids[0]), 5.0)
    assert not Path(folder).exists()


def fails_on_rank_1(config: Any, choice: DriverChoice, rank: int = 0) -> Any:
    """build_rank, except that rank 1 cannot load its shard."""
    if rank == 1:
        raise OSError("no room for the shard")
    return build_rank(config, choice, rank)


@pytest.mark.model
def test_a_rank_that_cannot_load_its_shard_is_named(tiny_llama: Path) -> None:
    config = _config(2, path=str(tiny_llama))
    choice = DriverChoice(driver="torch", device="cpu", dtype=torch.float32, reason="")
    with pytest.raises(
        RankStartError, match="tensor-parallel rank 1 failed to start: OSError: no room"
    ):
        start_ranks(config, choice, fails_on_rank_1)
    start_ranks(config, choice, build_rank)[0].close()  # the process group was left


@pytest.mark.unit
@pytest.mark.parametrize(
    ("model", "driver", "refusal"),
    [
        ({"tensor_parallel": 0}, {}, "tensor_parallel must be >= 1, got 0"),
        ({"tensor_parallel": 2, "weights": "int4"}, {}, "shards float weights"),
        ({"tensor_parallel": 2, "adapters": {"a": "x"}}, {}, "adapters run on one rank"),
        ({"tensor_parallel": 2}, {"backend": "cuda"}, "runs on the torch driver"),
    ],
)
def test_settings_that_cannot_shard_are_refused(
    model: dict[str, Any], driver: dict[str, Any], refusal: str
) -> None:
    with pytest.raises((ConfigError, ValueError), match=refusal):
        config_from_dict({"model": model, "driver": driver})


@pytest.mark.unit
def test_several_models_or_a_one_rank_benchmark_refuse_ranks() -> None:
    one = {"tensor_parallel": 2, "path": "x"}
    with pytest.raises((ConfigError, ValueError), match="applies to a single served model"):
        config_from_dict({"models": [{**one, "name": "a"}, {"name": "b", "path": "y"}]})
    with pytest.raises(ValueError, match="runs the model on one rank"):
        build_torch_driver(_config(2))


@pytest.mark.unit
@pytest.mark.parametrize("command", ["serve", "run", "generate"])
def test_the_tensor_parallel_flag_sets_the_model_key(command: str) -> None:
    extra = {"run": ["prog"], "generate": ["hello"]}.get(command, [])
    args = build_parser().parse_args([command, "--tensor-parallel", "2", *extra])
    assert engine_config(args).model.tensor_parallel == 2
