"""The records one inferlet instance keeps as its host functions see it: the models it may use,
its pollables, topic subscriptions and children."""

from __future__ import annotations

import collections
import threading
from typing import Any

from attrs import define, field

from pie.grammar import Grammars
from pie.sandbox.host.ports import FastPath, MediaPort


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
    lock: threading.Lock = field(factory=threading.Lock)
    """HF fast tokenizers are not safe to call from several threads at once."""


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
