"""`Model`: a model the engine serves, with its tokenizer and chat template."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence

from wit_world.imports import model as _model

from inferlet.errors import call
from inferlet.speech import SpeechRequest

Message = Mapping[str, str]
"""A chat message: {"role": "system" | "user" | "assistant" | "tool", "content": text}."""


class Model:
    """A handle on a loaded model. Get one with `get_model()` or `Model.load(name)`."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        info = call(_model.info, handle)
        self.name: str = info.name
        self.root: str = info.name
        """The model's own name, also when it is seen through an adapter (`with_adapter`)."""
        self.vocab_size: int = info.vocab_size
        self.page_size: int = info.page_size
        """Tokens per KV page."""
        self.max_batch_tokens: int = info.max_batch_tokens
        self.adapters: list[str] = list(info.adapters)
        """The LoRA adapters loaded with the model, by name (see `Context(adapter=...)`)."""
        self.inputs: tuple[str, ...] = tuple(info.inputs)
        """What the model reads: "text", and "image", "video", "audio" where it has the tower."""
        self.outputs: tuple[str, ...] = tuple(info.outputs)
        """What it produces: "text", and "speech" for a model that speaks."""
        self.adapter: str | None = None
        """The adapter contexts made on this model run through by default (`with_adapter`)."""
        self._stop_tokens: tuple[int, ...] | None = None

    @classmethod
    def load(cls, name: str = "") -> Model:
        """The model called `name`; the empty name is the engine's default model."""
        return cls(call(_model.load, name))

    def with_adapter(self, adapter: str) -> Model:
        """This model as seen through one of its LoRA `adapters`, the way servers list an
        adapter as a model of its own: contexts made on it run through the adapter, and its
        `name` is the adapter's."""
        if adapter not in self.adapters:
            raise ValueError(f"no LoRA adapter {adapter!r}; the model has {self.adapters}")
        view = copy.copy(self)
        view.name, view.adapter = adapter, adapter
        return view

    def encode(self, text: str) -> list[int]:
        return call(_model.encode, self.handle, text)

    def decode(self, tokens: Sequence[int]) -> str:
        return call(_model.decode, self.handle, list(tokens))

    def token_texts(self, tokens: Sequence[int]) -> list[str]:
        """The text of each token on its own (a vocabulary lookup)."""
        return call(_model.token_texts, self.handle, list(tokens))

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token texts and their ids."""
        return {t.text: t.id for t in call(_model.special_tokens, self.handle)}

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """Tokens that end a turn (end of sequence, end of message); fetched once."""
        if self._stop_tokens is None:
            self._stop_tokens = tuple(call(_model.stop_tokens, self.handle))
        return self._stop_tokens

    def format_chat(self, messages: Iterable[Message], cue: bool = False) -> str:
        """Renders messages with the model's chat template; `cue` appends the prompt that starts
        the assistant's turn."""
        wit = [_model.Message(role=m["role"], content=m["content"]) for m in messages]
        return call(_model.format_chat, self.handle, wit, cue)

    def speak(self, text: str) -> SpeechRequest:
        """A request for speech (a model whose `outputs` hold "speech"): chain `.speaker(voice)`
        and `.max_duration(seconds)`, then `await .generate()` for a `Speech`."""
        return SpeechRequest(self, text)

    def __repr__(self) -> str:
        return f"Model({self.name!r})"


def get_model(name: str = "") -> Model:
    """The model called `name`, or the engine's default model."""
    return Model.load(name)


def models() -> list[str]:
    """Names of the models the engine serves."""
    return _model.models()
