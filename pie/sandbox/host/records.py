"""The records one inferlet instance keeps as its host functions see it: the models it may use,
its pollables, topic subscriptions and children."""

from __future__ import annotations

import collections
import threading
from typing import Any

from attrs import define, field, frozen

from pie.grammar import Grammars
from pie.sandbox.host.failure import HostFailure
from pie.sandbox.host.ports import FastPath, MediaPort, SpeechPort


@define
class ModelView:
    """What the host needs of a model: its tokenizer and limits."""

    name: str
    tokenizer: Any
    vocab_size: int
    page_size: int
    max_batch_tokens: int
    grammars: Grammars | None = None
    """The model's grammar engine; None refuses constrained decoding."""
    adapters: tuple[str, ...] = ()
    """The LoRA adapters loaded with the model, by name."""
    kv: str = "kv"
    """The address of the kv actor that holds this model's contexts."""
    lanes: FastPath | None = None
    """This model's fast path for plain decodes, when the engine runs one."""
    inputs: tuple[str, ...] = ("text",)
    """What the model reads: text, and the media its towers take (image, video, audio)."""
    outputs: tuple[str, ...] = ("text",)
    """What it produces: text, or speech."""
    media: MediaPort | None = None
    """The model's media store, for a model with media towers."""
    speech: SpeechPort | None = None
    """The model's speech requests, for a model that speaks."""
    speech_holds: SpeechHolds | None = None
    """The engine's count of speech requests and clips (one for every model)."""
    lock: threading.Lock = field(factory=threading.Lock)
    """HF fast tokenizers are not safe to call from several threads at once."""


@frozen(kw_only=True)
class SpeechLimits:
    max_seconds: float
    per_inferlet: int
    per_user: int


class SpeechHolds:
    """Speech requests in flight and clips held, counted by instance and by user over the whole
    engine, within [media] limits (any thread)."""

    def __init__(self, limits: SpeechLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._by_instance: collections.Counter[str] = collections.Counter()
        self._by_user: collections.Counter[str] = collections.Counter()

    def take(self, instance: str, user: str) -> None:
        """Counts one more in, or raises HostFailure("quota") saying which bound it meets."""
        limits = self.limits
        with self._lock:
            if self._by_instance[instance] >= limits.per_inferlet:
                raise HostFailure(
                    "quota",
                    f"this inferlet already has {limits.per_inferlet} speech requests and clips;"
                    " free a clip first (media.max_speech_per_inferlet)",
                )
            if self._by_user[user] >= limits.per_user:
                raise HostFailure(
                    "quota",
                    f"user {user!r} already has {limits.per_user} speech requests and clips "
                    "(media.max_speech_per_user)",
                )
            self._by_instance[instance] += 1
            self._by_user[user] += 1

    def give(self, instance: str, user: str, count: int = 1) -> None:
        """Counts `count` of an instance's out (a clip freed, a request failed)."""
        with self._lock:
            count = min(count, self._by_instance[instance])
            for counts, key in ((self._by_instance, instance), (self._by_user, user)):
                counts[key] -= count
                if counts[key] <= 0:
                    del counts[key]

    def give_all(self, instance: str, user: str) -> None:
        """Counts out everything of an instance that has ended."""
        with self._lock:
            count = self._by_instance[instance]
        self.give(instance, user, count)

    def held(self, instance: str) -> int:
        with self._lock:
            return self._by_instance[instance]


@define
class Pending:
    """A pollable: filled in by `deliver` (or at once), taken once by the guest."""

    kind: str
    done: bool = False
    value: Any = None


@define
class Subscription:
    topic: str
    corr: int
    messages: collections.deque[tuple[str, int]] = field(factory=collections.deque)
    """What arrived before the guest asked for it, oldest first, each with its UTF-8 size."""
    bytes: int = 0
    waiting: collections.deque[int] = field(factory=collections.deque)
    dropped: int = 0


@define
class Child:
    instance: str | None = None
    end: Any = None
    waiting: list[int] = field(factory=list)
