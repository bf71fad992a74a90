"""Speech out: `model.speak(text).speaker(voice).max_duration(seconds).generate()` has a model
that speaks say `text` and returns the clip as a `Speech` (WAV bytes, or raw samples). The
engine steps the request between other programs' passes; awaiting it lets this program's other
branches run meanwhile."""

from __future__ import annotations

import struct
from typing import Any

from wit_world.imports import speech as _speech

from inferlet import _loop
from inferlet.errors import call

DEFAULT_SECONDS = 10.0
"""The longest clip a request asks for unless told (the engine's [media] speech_max_seconds
bounds it)."""


class Speech:
    """A clip the engine holds until `free()` (or the program's end)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        info = call(_speech.info, handle)
        self.sample_rate: int = info.sample_rate
        """Samples a second."""
        self.channels: int = info.channels
        self.samples: int = info.samples
        """Samples per channel."""

    def duration(self) -> float:
        """Seconds."""
        return self.samples / self.sample_rate

    def to_wav(self) -> bytes:
        """The clip as a WAV file of 16-bit PCM."""
        return bytes(call(_speech.wav, self.handle))

    def to_floats(self) -> list[float]:
        """The samples in [-1, 1], channels interleaved."""
        data = bytes(call(_speech.samples, self.handle))
        return list(struct.unpack(f"<{len(data) // 4}f", data))

    def free(self) -> None:
        call(_speech.free, self.handle)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        return f"Speech({self.duration():.2f}s at {self.sample_rate} Hz, {self.channels} ch)"


class SpeechRequest:
    """What to say and how; made by `Model.speak(text)`, sent by `generate()`."""

    def __init__(self, model: Any, text: str) -> None:
        self.model = model
        self.text = text
        self._speaker: int | None = None
        self._seconds = DEFAULT_SECONDS

    def speaker(self, voice: int) -> SpeechRequest:
        """One of `voices(model)` (default: the first)."""
        self._speaker = voice
        return self

    def max_duration(self, seconds: float) -> SpeechRequest:
        """The longest clip to produce; speech that ends sooner stops sooner."""
        self._seconds = seconds
        return self

    async def generate(self) -> Speech:
        speaker = self._speaker if self._speaker is not None else voices(self.model)[0]
        pending = call(_speech.speak, self.model.handle, self.text, speaker, float(self._seconds))
        await _loop.ready(pending)
        return Speech(call(_speech.spoken, pending))


def voices(model: Any) -> list[int]:
    """The speaker ids a model that speaks accepts."""
    return list(call(_speech.voices, model.handle))


def max_seconds(model: Any) -> float:
    """The longest clip the engine makes ([media] speech_max_seconds)."""
    seconds: float = call(_speech.max_seconds, model.handle)
    return seconds
