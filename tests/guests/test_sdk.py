"""The guest SDK inside real components, run against the fake host (fake_host.py): chat prompts,
the decode hot path, one poll for concurrent branches, streaming, seeds, snapshots, messaging,
and how failures read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.guests.fake_host import FakeHost, Message, run_guest
from tests.inferlet_fixtures import GUESTS, build_inferlet  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def probe(build_inferlet: Callable[[Path], Path]) -> Path:  # noqa: F811
    return build_inferlet(GUESTS / "sdk_probe")


@pytest.fixture(scope="module")
def misbehave(build_inferlet: Callable[[Path], Path]) -> Path:  # noqa: F811
    return build_inferlet(GUESTS / "misbehave")


def run(wasm: Path, tmp_path: Path, input: Any, host: FakeHost | None = None) -> Any:
    """The guest's result (parsed when it is JSON) or error text, its tag, and the host."""
    host = host or FakeHost()
    text = input if isinstance(input, str) else json.dumps(input)
    tag, value = run_guest(wasm, text, host, tmp_path)
    if tag == "ok":
        try:
            value = json.loads(value)
        except ValueError:
            pass
    return value, tag, host


def test_a_chat_prompt_is_prefilled_as_one_encode_of_its_whole_render(
    probe: Path, tmp_path: Path
) -> None:
    result, tag, host = run(probe, tmp_path, {"mode": "chat", "max_tokens": 5})
    rendered = host.format_chat([Message("system", "be brief"), Message("user", "hello")], True)
    assert tag == "ok" and result["text"] == "abcde" and result["stop"] == "length"
    assert host.prefilled[0] == result["prompt_tokens"] == len(host.encode(rendered))
    assert host.calls["model.encode"] == 1


def test_a_whole_generation_is_one_run_with_no_host_call_per_token(
    probe: Path, tmp_path: Path
) -> None:
    _, _, host = run(probe, tmp_path, {"mode": "chat", "max_tokens": 5})
    assert host.calls["generate.start"] == host.calls["generate.output"] == 1
    assert host.calls["forward.execute"] == host.calls["forward.step"] == 0
    assert host.calls["futures.poll"] <= 1
    assert host.calls["model.decode"] == 1  # once, for the final text
    assert host.calls["context.info"] == host.calls["context.tokens"] == 0
    assert host.calls["context.reserve"] == 1


def test_each_step_of_a_stepped_generation_is_one_host_call(probe: Path, tmp_path: Path) -> None:
    _, _, host = run(probe, tmp_path, {"mode": "stepwise", "max_tokens": 5})
    assert host.calls["forward.step"] == 5 + 1  # five steps, then the final flush
    assert host.calls["forward.execute"] == host.calls["futures.poll"] == 0


@pytest.mark.parametrize(
    "settings",
    [
        {"max_tokens": 6},
        {"max_tokens": 40, "prompt": "x"},
        {"max_tokens": 20, "stops": ["fgh"]},
        {"max_tokens": 20, "stops": ["e", "zz"], "prompt": "b"},
        {"max_tokens": 12, "seed": 5},
        {"max_tokens": 30, "seed": 11, "stops": ["q"]},
    ],
)
def test_a_run_gives_what_stepping_gives(
    probe: Path, tmp_path: Path, settings: dict[str, Any]
) -> None:
    stepped, _, _ = run(probe, tmp_path, {"mode": "stepwise", **settings})
    ran, _, host = run(probe, tmp_path, {"mode": "whole", **settings})
    assert ran == stepped
    assert host.calls["generate.start"] == 1


def test_a_second_turn_continues_the_chat_exactly_as_the_template_renders_it(
    probe: Path, tmp_path: Path
) -> None:
    result, _, host = run(probe, tmp_path, {"mode": "multi-turn"})
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    assert (result["first"], result["second"]) == (alphabet, "abc")
    turns = [
        Message("user", "one"),
        Message("assistant", alphabet),
        Message("user", "two"),
        Message("assistant", "abc"),
    ]
    assert result["context"] == host.format_chat(turns, False)


def test_concurrent_branches_wait_in_one_poll(probe: Path, tmp_path: Path) -> None:
    result, _, host = run(probe, tmp_path, {"mode": "gather", "n": 5})
    assert result == ["xyz"] * 5
    assert host.poll_sizes == [5]


def test_streaming_stops_at_a_stop_string_without_showing_it(probe: Path, tmp_path: Path) -> None:
    input = {"mode": "stream", "max_tokens": 20, "stops": ["fgh"]}
    result, _, _ = run(probe, tmp_path, input)
    assert result == {"pieces": list("abcde"), "text": "abcde", "stop": "stop_string"}


def test_a_seed_repeats_a_generation_and_another_seed_does_not(probe: Path, tmp_path: Path) -> None:
    (same, again, other), _, host = run(probe, tmp_path, {"mode": "seeded"})
    assert same == again and same != other


def test_misuse_is_reported_in_words(probe: Path, tmp_path: Path) -> None:
    result, _, host = run(probe, tmp_path, {"mode": "errors"})
    assert result["open"] == "no-such-snapshot"
    assert "flush() before forward()" in result["forward"]
    assert "flush() before save()" in result["save"]
    assert "busy" in result["busy"]
    assert host.calls["futures.discard"] == 1  # the abandoned generation's pass


def test_a_fork_of_an_opened_snapshot_prefills_only_the_new_turn(
    probe: Path, tmp_path: Path
) -> None:
    result, _, host = run(probe, tmp_path, {"mode": "snapshot"})
    system = host.format_chat([Message("system", "shared")], False)
    full = host.format_chat([Message("system", "shared"), Message("user", "q")], True)
    assert result["snapshot_tokens"] == len(host.encode(system))
    assert result["prompt_tokens"] == len(host.encode(full)) - len(host.encode(system))
    assert result["context"] == full + "a"


def test_messaging_and_runtime_calls_reach_the_host(probe: Path, tmp_path: Path) -> None:
    result, _, _ = run(probe, tmp_path, {"mode": "io"})
    assert result["pulled"] == "job-1" and result["news"].startswith("message")
    assert result["child"].startswith("child says")
    assert result["runtime"] == ["fake", "fake-1", "tester"]


def test_http_requests_carry_method_headers_body_and_timeout(probe: Path, tmp_path: Path) -> None:
    result, _, _ = run(probe, tmp_path, {"mode": "fetch"})
    echo = result["echo"]
    assert echo["method"] == "POST" and echo["url"] == "http://echo.test/items"
    assert echo["headers"] == {"x-key": "k", "content-type": "application/json"}
    assert echo["body"] == '{"n": 1}' and echo["timeout-ms"] == 2500
    assert result["type"] == "application/json"
    assert result["denied"] == "denied"


def test_a_raw_forward_pass_returns_outputs_in_slot_order(probe: Path, tmp_path: Path) -> None:
    result, _, _ = run(probe, tmp_path, {"mode": "forward"})
    assert result["tokens"] == [ord("b"), ord("d")]
    assert result["dist"] == [ord("d"), ord("e")]
    assert result["entropy"] == pytest.approx(0.802, abs=1e-3)


def test_input_and_results_follow_the_json_convention(probe: Path, tmp_path: Path) -> None:
    assert run(probe, tmp_path, "not json")[0] == {"type": "str", "value": "not json"}
    error, tag, _ = run(probe, tmp_path, {"mode": "unjson"})
    assert tag == "err" and error.startswith("TypeError: main returned a set")


def test_timers_work_and_waiting_on_nothing_fails_clearly(probe: Path, tmp_path: Path) -> None:
    assert run(probe, tmp_path, {"mode": "sleep"})[0] == "slept"
    error, tag, _ = run(probe, tmp_path, {"mode": "deadlock"})
    assert tag == "err" and "waiting for something that can never happen" in error


def test_an_exception_in_main_reads_as_type_message_and_line(
    misbehave: Path, tmp_path: Path
) -> None:
    error, tag, _ = run(misbehave, tmp_path, {"mode": "raise"})
    assert tag == "err"
    assert error.splitlines()[0] == "ValueError: boom"
    assert 'File "main.py", line' in error and "in main" in error
    assert "asyncio" not in error


def test_guest_prints_reach_its_stdout_and_stderr(misbehave: Path, tmp_path: Path) -> None:
    result, _, _ = run(misbehave, tmp_path, {"mode": "stdout"})
    assert result == "printed"
    assert (tmp_path / "stdout.txt").read_text() == "to stdout\n"
    assert (tmp_path / "stderr.txt").read_text() == "to stderr\n"
