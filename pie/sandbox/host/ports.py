"""What an instance's host calls reach of the engine, as protocols the engine fills at wiring
time: the bridge that posts events to the actors, and the fast path for plain decodes. The
sandbox imports neither the actors nor the data plane."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pie.events.forward import MediaRun
from pie.events.sampling import SamplingSlot


class Bridge(Protocol):
    def post(self, dst: str, event: Any) -> None:
        """Hands `event` to the engine from the guest thread, without waiting."""


class FastPath(Protocol):
    """The engine's fast path for plain decodes, as the host calls use it (the engine injects
    its lanes). Both methods raise `pie.events.speculation.LaneBusy` while the context has a
    pass its program has not received."""

    def submit(
        self,
        context: int,
        requester: str,
        corr: int,
        tokens: Sequence[int],
        positions: Sequence[int] | None,
        slots: Sequence[SamplingSlot],
        deliver: Callable[[Any], None],
        *,
        adapter: str | None = None,
    ) -> bool:
        """Takes the pass onto the context's lane; False when it must go the slow way (as a
        pass through another LoRA adapter than the lane's lease must)."""

    def close(self, context: int, requester: str, *, running_ok: bool = False) -> None:
        """Takes the context off the fast path before a command that changes it."""


class MediaPort(Protocol):
    """A model's media store, as the host calls use it (the engine injects the driver's)."""

    def add(
        self, kind: str, data: bytes, max_frames: int | None = None, *, user: str | None = None
    ) -> Any:
        """Decodes and prepares `data`; an item with `key` and `prepared` (kind, grid,
        token_count, soft_count). Raises an error with a `kind` word for media it refuses
        (`quota` past `user`'s bound)."""

    def release(self, key: str, *, user: str | None = None) -> None: ...

    @property
    def chat_placeholders(self) -> Mapping[str, str]:
        """Per kind, what the model's chat template renders for a medium of that kind."""

    def place(self, key: str, start: int) -> tuple[list[int], list[int], tuple[MediaRun, ...]]:
        """The item's tokens laid out from position `start`: (tokens, positions, media runs)."""


class SpeechPort(Protocol):
    """A speaking model's speech requests, as the host calls use them (the engine injects the
    pass loop's speech desk)."""

    def voices(self) -> tuple[int, ...]: ...

    def prompt_ids(
        self, text: str, speaker: int, tokenize: Callable[[str], Sequence[int]]
    ) -> list[int]: ...

    def frames_for(self, seconds: float, prompt_tokens: int) -> int:
        """Frames in `seconds` of audio that fit beside a prompt (0: none do)."""

    def speak(
        self,
        requester: str,
        token_ids: Sequence[int],
        max_frames: int,
        deliver: Callable[[Any], None],
    ) -> None:
        """Queues a request whose clip (or RequestFailed) goes to `deliver`; ValueError for one
        the model refuses."""

    def cancel(self, requester: str) -> None: ...


class LaunchTrace(Protocol):
    """The spans of one traced launch (pie/observe/tracing.py): one per host-call family, opened
    when the call starts and closed when its pollable or run is taken or discarded."""

    def opened(
        self,
        handle: int,
        name: str,
        corr: int | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None: ...

    def closed(
        self, handle: int, failure: Any = None, attributes: Mapping[str, Any] | None = None
    ) -> None: ...
