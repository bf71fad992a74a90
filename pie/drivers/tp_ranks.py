"""Tensor-parallel ranks of one model replica: rank 0 (the engine's process) starts ranks
1..N-1 as processes, joins them on torch.distributed, and broadcasts each batch so that every
rank runs its shard of the pass; rank 0 alone samples. Ranks exit when rank 0 stops or dies."""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from pie.config import EngineConfig
from pie.drivers.base import DriverError
from pie.drivers.batch import ForwardBatch
from pie.drivers.batch_checks import validate_batch
from pie.drivers.select import DriverChoice
from pie.drivers.tokenizer import Tokenizer
from pie.drivers.torch_driver import TorchDriver
from pie.events.sampling import SlotOutput

LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
"""The ranks' own connections stay on loopback unless the environment names an interface."""
START_SECONDS = 120.0
"""How long rank 0 waits for the other ranks to load their shards."""
STOP_SECONDS = 10.0
"""How long a rank may take to leave after rank 0 says stop, before it is killed."""
PARENT_POLL_SECONDS = 0.5

BuildRank = Callable[[EngineConfig, DriverChoice, int], tuple[TorchDriver, Tokenizer]]


class RankStartError(RuntimeError):
    """A tensor-parallel rank exited, failed to load its shard, or did not join in time."""


def all_reduce(tensor: torch.Tensor) -> None:
    """Sums `tensor` in place over every rank (the row-parallel layers' reduce)."""
    dist.all_reduce(tensor)


def rank_choice(choice: DriverChoice, rank: int, ranks: int) -> DriverChoice:
    """The torch driver on the rank's device: the CPU for every rank, or GPU `rank` on CUDA."""
    if not choice.device.startswith("cuda"):
        return attrs.evolve(choice, driver="torch")
    if torch.cuda.device_count() < ranks:
        raise ValueError(
            f"tensor_parallel = {ranks} on CUDA needs {ranks} GPUs, and "
            f"{torch.cuda.device_count()} are visible"
        )
    return attrs.evolve(choice, driver="torch", device=f"cuda:{rank}")


def _backend(choice: DriverChoice) -> str:
    return "nccl" if choice.device.startswith("cuda") else "gloo"


class RankGroup:
    """The processes of ranks 1..N-1 and the store they meet at, seen from rank 0: a file in
    a private folder (no listening socket), which `stop` removes."""

    def __init__(
        self, folder: str, ranks: int, processes: Sequence[subprocess.Popen[bytes]]
    ) -> None:
        self.folder = folder
        self.store = _store(folder, ranks)
        self.processes = processes

    def wait_for(self, stage: str, deadline: float) -> None:
        """Until every rank has reached `stage`; RankStartError naming the first rank that
        exited, reported an error there, or missed the deadline."""
        for rank, process in enumerate(self.processes, start=1):
            key = f"{stage}/{rank}"
            while not self.store.check([key]):
                if process.poll() is not None:
                    raise RankStartError(
                        f"tensor-parallel rank {rank} exited with code {process.returncode} "
                        f"before it was {stage} (its error is above)"
                    )
                if time.monotonic() > deadline:
                    raise RankStartError(
                        f"tensor-parallel rank {rank} was not {stage} within {START_SECONDS:g} s"
                    )
                time.sleep(0.05)
            error = self.store.get(key).decode()
            if error:
                raise RankStartError(f"tensor-parallel rank {rank} failed to start: {error}")

    def stop(self) -> None:
        """Waits for the ranks to leave, killing any still there after STOP_SECONDS."""
        deadline = time.monotonic() + STOP_SECONDS
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class TensorParallelDriver:
    """Rank 0's driver: broadcasts each valid batch to the other ranks, then runs its own shard
    with them; the outputs are rank 0's (every rank holds the same logits after the reduce)."""

    def __init__(self, driver: TorchDriver, group: RankGroup) -> None:
        self.driver = driver
        self.group = group
        self.info = driver.info
        self.ranks = len(group.processes) + 1
        self._closed = False

    def forward(self, batch: ForwardBatch) -> list[SlotOutput]:
        if self._closed:
            raise DriverError("the tensor-parallel ranks have stopped")
        # A batch every rank would refuse never reaches them.
        validate_batch(batch, self.info)
        dist.broadcast_object_list([batch], src=0)
        return self.driver.forward(batch)

    def statistics(self) -> Any:
        return self.driver.statistics()

    def memory_bytes(self) -> tuple[int, int, int, str]:
        """Rank 0's share: its model shard and its heads' part of every KV page."""
        return self.driver.memory_bytes()

    def close(self) -> None:
        """Tells the other ranks to leave, waits for them and leaves the process group."""
        if self._closed:
            return
        self._closed = True
        try:
            dist.broadcast_object_list([None], src=0)
        except RuntimeError:
            pass  # a rank already gone: stop() below kills the rest
        self.group.stop()
        dist.destroy_process_group()


def start_ranks(
    config: EngineConfig, choice: DriverChoice, build_rank: BuildRank
) -> tuple[TensorParallelDriver, Tokenizer]:
    """Builds rank 0's shard here, starts the other ranks with the same KV pool size, and joins
    them; RankStartError when one of them cannot start."""
    ranks = config.model.tensor_parallel
    if dist.is_initialized():
        raise ValueError("this process already runs a tensor-parallel model; it holds one")
    choice = rank_choice(choice, 0, ranks)
    driver, tokenizer = build_rank(config, choice, 0)
    # Every rank must hold the same pages: the others take rank 0's count, not their own guess.
    fixed = attrs.evolve(config, kv=attrs.evolve(config.kv, num_pages=driver.info.num_pages))
    processes: list[subprocess.Popen[bytes]] = []
    group = RankGroup(tempfile.mkdtemp(prefix="pie-tp-"), ranks, processes)
    deadline = time.monotonic() + START_SECONDS
    try:
        for rank in range(1, ranks):
            args = (fixed, choice, rank, group.folder, os.getpid(), build_rank)
            processes.append(_spawn(args))
        group.wait_for("joining", deadline)
        _join(choice, group.store, 0, ranks)
        group.wait_for("ready", deadline)
    except BaseException:
        for process in processes:
            process.kill()
        group.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return TensorParallelDriver(driver, group), tokenizer


def _store(folder: str, ranks: int) -> dist.Store:
    store = dist.FileStore(os.path.join(folder, "store"), ranks)
    store.set_timeout(datetime.timedelta(seconds=START_SECONDS))
    return store


def _join(choice: DriverChoice, store: dist.Store, rank: int, ranks: int) -> None:
    for name, value in LOOPBACK.items():
        os.environ.setdefault(name, value)
    if choice.device.startswith("cuda"):
        # NCCL collectives (and broadcast_object_list's buffers) use the current device.
        torch.cuda.set_device(choice.device)
    dist.init_process_group(
        _backend(choice),
        store=store,
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=START_SECONDS),
    )


def _spawn(args: tuple[Any, ...]) -> subprocess.Popen[bytes]:
    """A fresh interpreter running `rank_entry` on `args`. Not multiprocessing's spawn, which
    imports the parent's __main__ again: a script that opens an engine at its top level
    would then start the engine in every rank."""
    process = subprocess.Popen(
        [sys.executable, "-c", "from pie.drivers.tp_ranks import rank_entry; rank_entry()"],
        stdin=subprocess.PIPE,
    )
    assert process.stdin is not None
    # The parent's import path first, so that `args` unpickles wherever its functions live.
    process.stdin.write(pickle.dumps(sys.path) + pickle.dumps(args))
    process.stdin.close()
    return process


def rank_entry() -> None:
    """The rank process's start: reads the import path and its arguments from stdin."""
    sys.path[:] = pickle.load(sys.stdin.buffer)
    _rank_main(*pickle.load(sys.stdin.buffer))


def _rank_main(
    config: EngineConfig,
    choice: DriverChoice,
    rank: int,
    folder: str,
    parent: int,
    build_rank: BuildRank,
) -> None:
    """A rank process: join, load the shard, then run every pass rank 0 broadcasts."""
    _exit_with_parent(parent, folder)
    ranks = config.model.tensor_parallel
    store = _store(folder, ranks)
    store.set(f"joining/{rank}", "")
    choice = rank_choice(choice, rank, ranks)
    _join(choice, store, rank, ranks)
    try:
        driver, _ = build_rank(config, choice, rank)
    except Exception as exc:
        store.set(f"ready/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    store.set(f"ready/{rank}", "")
    try:
        _serve(driver, rank)
    finally:
        # The store is needed only to join; once rank 0 is gone (stopped, or its connections
        # broken by its death) no one else is left to remove it.
        shutil.rmtree(folder, ignore_errors=True)
    dist.destroy_process_group()


def _serve(driver: TorchDriver, rank: int) -> None:
    """Runs each broadcast batch until rank 0 sends None (stop)."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        batch = box[0]
        if batch is None:
            return
        try:
            driver.forward(batch)
        except DriverError as exc:
            # Rank 0 refuses the same batch at the same point, so the ranks stay in step.
            print(f"pie: tensor-parallel rank {rank}: {exc}", file=sys.stderr)


def _exit_with_parent(parent: int, folder: str) -> None:
    """Ends this process as soon as rank 0's process is gone, however it ended (a SIGKILL
    gives it no chance to say stop), so that no rank outlives the engine; the store's folder,
    which rank 0 could not remove then, goes with it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="pie-tp-parent-watch", daemon=True).start()
