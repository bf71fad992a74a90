"""The speech desk without a model or a thread: requests take one step each in turn, a finished
one is decoded and delivered, a program's requests are dropped when it ends, a failing request
fails alone, and the frame budget respects the model's positions."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from pie.dataplane.speech import SpeechDesk
from pie.events.kv import RequestFailed

pytestmark = pytest.mark.unit


class FakeUtterance:
    def __init__(self, name: str, frames: int, log: list[str], fail_at: int | None) -> None:
        self.name, self.frames, self.log, self.fail_at = name, frames, log, fail_at
        self.done = 0

    def step(self) -> bool:
        if self.done == self.fail_at:
            raise RuntimeError("boom")
        self.done += 1
        self.log.append(self.name)
        return self.done == self.frames

    def codes(self) -> Any:
        return (self.name, self.done)


class FakeSpeaker:
    frame_rate = 10.0
    max_positions = 20

    def __init__(self) -> None:
        self.log: list[str] = []

    def voices(self) -> tuple[int, ...]:
        return (0,)

    def prompt_ids(
        self, text: str, speaker: int, tokenize: Callable[[str], Sequence[int]]
    ) -> list[int]:
        return list(tokenize(text))

    def utterance(self, token_ids: Sequence[int], max_frames: int) -> FakeUtterance:
        if max_frames < 1:
            raise ValueError("no frames")
        fail_at = 1 if token_ids[0] < 0 else None
        return FakeUtterance(str(token_ids[0]), max_frames, self.log, fail_at)

    def to_speech(self, codes: Any) -> Any:
        return f"clip {codes}"


def desk() -> tuple[SpeechDesk, FakeSpeaker, list[tuple[str, Any]]]:
    speaker = FakeSpeaker()
    return SpeechDesk(speaker, threading.Condition()), speaker, []


def drain(desk: SpeechDesk) -> None:
    for _ in range(100):
        desk.step()


def test_requests_take_turns_one_frame_each_and_are_delivered_when_decoded() -> None:
    speech, speaker, got = desk()
    speech.speak("a", [1], 3, lambda v: got.append(("a", v)))
    speech.speak("b", [2], 1, lambda v: got.append(("b", v)))
    speech.step()
    speech.step()
    assert speaker.log == ["1", "2"] and got == []
    speech.step()  # a's second frame; then b is decoded and delivered
    speech.step()
    assert got == [("b", "clip ('2', 1)")]
    drain(speech)
    assert speaker.log == ["1", "2", "1", "1"]
    assert got[-1] == ("a", "clip ('1', 3)")
    stats = speech.statistics()
    assert (stats.requests, stats.active, stats.most_active, stats.frames) == (2, 0, 2, 4)


def test_an_ended_programs_requests_are_dropped_undelivered() -> None:
    speech, speaker, got = desk()
    speech.speak("a", [1], 5, lambda v: got.append(("a", v)))
    speech.speak("b", [2], 2, lambda v: got.append(("b", v)))
    speech.step()
    speech.cancel("a")
    drain(speech)
    assert speaker.log == ["1", "2", "2"]
    assert got == [("b", "clip ('2', 2)")]
    assert speech.statistics().active == 0


def test_a_failing_request_fails_alone() -> None:
    speech, _, got = desk()
    speech.speak("a", [-1], 3, lambda v: got.append(("a", v)))
    speech.speak("b", [2], 2, lambda v: got.append(("b", v)))
    drain(speech)
    failed = dict(got)["a"]
    assert isinstance(failed, RequestFailed) and failed.kind == "driver"
    assert "boom" in failed.message
    assert dict(got)["b"] == "clip ('2', 2)"
    assert speech.statistics().failed == 1


def test_a_refused_request_raises_at_once_and_queues_nothing() -> None:
    speech, _, _ = desk()
    with pytest.raises(ValueError, match="no frames"):
        speech.speak("a", [1], 0, lambda v: None)
    assert not speech.busy


@pytest.mark.parametrize(
    ("seconds", "prompt", "frames"), [(1.0, 4, 10), (3.0, 4, 16), (1.0, 20, 0), (0.01, 4, 1)]
)
def test_frames_follow_the_seconds_within_the_models_positions(
    seconds: float, prompt: int, frames: int
) -> None:
    speech, _, _ = desk()
    assert speech.frames_for(seconds, prompt) == frames
