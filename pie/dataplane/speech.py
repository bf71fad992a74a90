"""Speech requests on the driver thread: each one is an utterance stepped a frame at a time, in
turn with the others and between forward passes (the pass loop calls `step` after each pass), so
neither text passes nor other utterances wait for a whole clip. An utterance keeps its own KV
outside the page pool; the host bounds how many there are and how long each may speak."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from attrs import define, frozen

from pie.events.kv import RequestFailed


class Utterance(Protocol):
    def step(self) -> bool:
        """One bounded unit of work; whether the utterance is done."""

    def codes(self) -> Any: ...


class Speaker(Protocol):
    """A model that speaks (pie.drivers.models.csm is one)."""

    @property
    def frame_rate(self) -> float: ...

    @property
    def max_positions(self) -> int: ...

    def voices(self) -> tuple[int, ...]: ...

    def prompt_ids(
        self, text: str, speaker: int, tokenize: Callable[[str], Sequence[int]]
    ) -> list[int]: ...

    def utterance(self, token_ids: Sequence[int], max_frames: int) -> Utterance:
        """Checks the request (ValueError) and returns its state; computes nothing yet."""

    def to_speech(self, codes: Any) -> Any: ...


@define(eq=False)
class _Job:
    requester: str
    utterance: Utterance
    deliver: Callable[[Any], None]
    spoken: bool = False
    cancelled: bool = False


@frozen(kw_only=True)
class SpeechStatistics:
    requests: int
    """Requests taken so far."""
    active: int
    """Requests not yet finished."""
    most_active: int
    """The most requests unfinished at once."""
    frames: int
    """Frames picked so far (each one step)."""
    failed: int


class SpeechDesk:
    """A speaking model's requests, stepped by the pass loop. `cond` is the pass loop's: a new
    request wakes it."""

    def __init__(self, speaker: Speaker, cond: threading.Condition) -> None:
        self.speaker = speaker
        self._cond = cond
        self._jobs: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._requests = self._frames = self._failed = self._most = 0

    # -- program threads ---------------------------------------------------------------------

    def voices(self) -> tuple[int, ...]:
        return self.speaker.voices()

    def prompt_ids(
        self, text: str, speaker: int, tokenize: Callable[[str], Sequence[int]]
    ) -> list[int]:
        return self.speaker.prompt_ids(text, speaker, tokenize)

    def frames_for(self, seconds: float, prompt_tokens: int) -> int:
        """Frames in `seconds` of audio that fit beside a prompt (0: none do)."""
        wanted = max(1, round(seconds * self.speaker.frame_rate))
        return max(0, min(wanted, self.speaker.max_positions - prompt_tokens))

    def speak(
        self,
        requester: str,
        token_ids: Sequence[int],
        max_frames: int,
        deliver: Callable[[Any], None],
    ) -> None:
        """Queues a request; `deliver` gets its clip, or a RequestFailed, on the driver thread.
        Raises ValueError for a request the model refuses."""
        job = _Job(requester, self.speaker.utterance(token_ids, max_frames), deliver)
        with self._cond:
            self._jobs.append(job)
            self._requests += 1
            self._most = max(self._most, self._active())
            self._cond.notify_all()

    def cancel(self, requester: str) -> None:
        """Drops every request of `requester` (which is gone) undelivered."""
        with self._cond:
            kept = [job for job in self._jobs if job.requester != requester]
            self._jobs = collections.deque(kept)
            if self._running is not None and self._running.requester == requester:
                self._running.cancelled = True

    def statistics(self) -> SpeechStatistics:
        with self._cond:
            return SpeechStatistics(
                requests=self._requests,
                active=self._active(),
                most_active=self._most,
                frames=self._frames,
                failed=self._failed,
            )

    def _active(self) -> int:
        return len(self._jobs) + (self._running is not None)

    # -- the pass loop (driver thread) -------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a request waits for a step (read under `cond`)."""
        return bool(self._jobs)

    def step(self) -> None:
        """One frame of the request whose turn it is, or the decoding of a finished one's clip
        and its delivery."""
        with self._cond:
            if not self._jobs:
                return
            job = self._running = self._jobs.popleft()
        result = self._advance(job)
        with self._cond:
            self._running = None
            if result is None and not job.cancelled:
                self._jobs.append(job)
        if result is not None and not job.cancelled:
            job.deliver(result)

    def _advance(self, job: _Job) -> Any:
        """None while the request has more to do; else its clip or its failure."""
        try:
            if not job.spoken:
                job.spoken = job.utterance.step()
                self._frames += 1
                return None
            return self.speaker.to_speech(job.utterance.codes())
        except Exception as exc:  # one request's failure must not stop the others
            self._failed += 1
            return RequestFailed(corr=0, kind="driver", message=f"speech failed: {exc}")
