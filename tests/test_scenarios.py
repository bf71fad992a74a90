"""The scenarios in scenarios/, run against one `pie serve` child process on the real default
model: a multi-turn chat that prefills only each new turn, 32 concurrent clients whose batched
results equal their solo runs, a completion streamed piece by piece, and a swarm of agent
inferlets whose traffic its client watches."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pie.client import SessionMessage, connect
from pie.client.local import LocalServer
from pie.drivers.tokenizer import Tokenizer
from pie.eventlog import read_log
from scenarios._support import TEXT_COMPLETION, build, result_of
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.model

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def load_scenario(name: str) -> ModuleType:
    """scenarios/<name>/run.py as a module (the folder names are not identifiers)."""
    spec = importlib.util.spec_from_file_location(
        f"scenario_{name.replace('-', '_')}", SCENARIOS / name / "run.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cache_folder(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory, name: str
) -> Path:
    cache = getattr(pytestconfig, "cache", None)
    return Path(tmp_path_factory.mktemp(name) if cache is None else cache.mkdir(name))


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the server keeps across restarts, and its event log (events.jsonl)."""
    return tmp_path_factory.mktemp("pie-serve-state")


@pytest.fixture(scope="module")
def server(
    default_model_dir: Path,  # noqa: F811
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
    state: Path,
) -> Iterator[LocalServer]:
    """`pie serve` on the default model; compiled components stay in pytest's cache, while what
    the server keeps across restarts (installed programs, named snapshots) starts afresh."""
    components = cache_folder(pytestconfig, tmp_path_factory, "pie-serve")
    env = {**os.environ, "PIE_CACHE_DIR": str(components)}
    config = state / "pie.toml"
    config.write_text(
        f'[server]\nprograms_dir = "{state / "programs"}"\n'
        f'[kv]\nsnapshots_dir = "{state / "snapshots"}"\n'
        f'[event_log]\npath = "{state / "events.jsonl"}"\n'
    )
    local = LocalServer.start(default_model_dir, env=env, args=["--config", str(config)])
    try:
        yield local
    finally:
        code = local.stop(grace=60)
        assert code == 0, f"pie serve exited with {code}:\n{local.log_tail()}"


@pytest.fixture(scope="module")
def inferlets(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built inferlets, shared with the other tests that build them."""
    return cache_folder(pytestconfig, tmp_path_factory, "pie-inferlets")


def test_chat_session_prefills_only_each_new_turn(
    server: LocalServer,
    inferlets: Path,
    default_model_dir: Path,  # noqa: F811
) -> None:
    report = load_scenario("chat-session").run(server.url, cache_dir=inferlets)
    assert all(report["checks"].values()), report["checks"]
    turns = report["turns"]
    assert report["returned"] == len(turns) == len(report["messages"])
    assert all(turn["reply"].strip() for turn in turns)
    # The chat's first turn renders exactly as text-completion's prompt, so greedy must agree.
    assert turns[0]["reply"] == report["single_turn"]
    tokenizer = Tokenizer.from_folder(default_model_dir)
    expected = turn_prefills(tokenizer, report["messages"], turns)
    assert [turn["prefilled"] for turn in turns] == expected
    for turn in turns[1:]:
        assert 2 * turn["prefilled"] < turn["context_tokens"], turn


def turn_prefills(
    tokenizer: Tokenizer, messages: list[str], turns: list[dict[str, Any]]
) -> list[int]:
    """The tokens each turn should feed: the template's text for that turn (closing the last
    reply, the user message, the assistant cue). A reply cut off by max_tokens leaves its last
    token unwritten, so the next turn feeds it too; a stop token is replaced by the template's
    own closing text."""
    history: list[dict[str, str]] = []
    rendered = ""
    counts = []
    for index, (text, turn) in enumerate(zip(messages, turns, strict=True)):
        history.append({"role": "user", "content": text})
        prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
        assert prompt.startswith(rendered)
        carried = 1 if index and turns[index - 1]["finish"] == "length" else 0
        counts.append(len(tokenizer.encode(prompt[len(rendered) :])) + carried)
        history.append({"role": "assistant", "content": turn["reply"]})
        rendered = prompt + turn["reply"]
    return counts


def test_many_clients_batch_and_match_their_solo_runs(server: LocalServer, inferlets: Path) -> None:
    report = load_scenario("many-clients").run(server.url, cache_dir=inferlets)
    assert all(report["checks"].values()), report["checks"]
    assert len(report["results"]) == report["clients"] == 32
    for prompt, result in zip(report["prompts"], report["results"], strict=True):
        assert result == report["alone"][prompt]
    print(f"many-clients: mean batch size {report['mean_batch_size']:.1f}")
    assert report["mean_batch_size"] >= 2.0


async def test_streamed_completion_sends_its_result_piece_by_piece(
    server: LocalServer, inferlets: Path
) -> None:
    wasm = build(TEXT_COMPLETION, inferlets)
    request = {"prompt": "Why is the sky blue?", "max_tokens": 12, "temperature": 0}
    async with connect(server.url) as client:
        program = (await client.install(wasm, name="text-completion")).hash
        plain = await result_of(client, program, request)
        inferlet = await client.launch(program, {**request, "stream": True})
        pieces = [
            event.text async for event in inferlet.events() if isinstance(event, SessionMessage)
        ]
    assert inferlet.outcome is not None and inferlet.outcome.ok, inferlet.outcome
    assert inferlet.outcome.result == plain == "".join(p or "" for p in pieces)
    assert len(pieces) > 1


def test_swarm_pipeline_runs_every_agent_and_the_watcher_sees_it(
    server: LocalServer, inferlets: Path
) -> None:
    report = load_scenario("swarm").run(server.url, cache_dir=inferlets)
    assert all(report["checks"].values()), (report["checks"], report["error"])
    stages = [message["stage"] for message in report["watched"]]
    assert stages == ["plan", "drafts", "drafts", "drafts", "critique", "answer"]
    senders = {message["sender"] for message in report["watched"]}
    assert len(senders) == len(report["agents"]) == 6
    assert report["answer"] == report["watched"][-1]["text"] != ""


def test_the_recorded_swarm_replays_exactly_through_every_core(
    server: LocalServer, state: Path
) -> None:
    """Everything the server ran so far (the swarm's agents, their bus traffic, the chat and the
    many clients) is in its event log; `pie replay` rebuilds every pure core from it."""
    log = _quiet_log(state / "events.jsonl")
    replayed = _pie("replay", str(log))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    lines = replayed.stdout.splitlines()
    names = [line.split(":")[0] for line in lines if not line.startswith(" ")]
    assert names == ["kv", "bus", "inferlets", "inference.former"], replayed.stdout
    assert all(": exact" in line for line in lines), replayed.stdout
    counts = {line.split(":")[0]: int(line.split("replayed ")[1].split()[0]) for line in lines}
    assert min(counts.values()) > 10, counts  # the bus carried the swarm's messages

    launch = next(e for e in read_log(log) if type(e.event).__name__ == "LaunchInferlet")
    tree = _pie("log", str(log), "--tree", str(launch.seq), "--limit", "400")
    assert tree.returncode == 0 and "[0]" in tree.stdout and "[3]" in tree.stdout, tree.stdout


def _quiet_log(log: Path) -> Path:
    """The server's event log once its writer has caught up (its size stops changing)."""
    size, deadline = -1, time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if log.stat().st_size == size:
            return log
        size = log.stat().st_size
    raise AssertionError("the event log kept growing")


def _pie(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pie.cli", *args], capture_output=True, text=True, timeout=300
    )
