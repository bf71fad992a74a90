"""Chat state of a context: the messages so far and their render, so each chat call queues
exactly the text the model's template adds for it."""

from __future__ import annotations

from collections.abc import Iterable

from inferlet.model import Message, Model


class ChatState:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.messages: list[dict[str, str]] = []
        self.rendered = ""
        """The template's render of `messages` (with the cue when `cued`)."""
        self.cued = False

    def copy(self) -> ChatState:
        other = ChatState(self.model)
        other.messages = [dict(m) for m in self.messages]
        other.rendered, other.cued = self.rendered, self.cued
        return other

    def assume(self, messages: Iterable[Message]) -> None:
        """Declares that the context already holds `messages` (e.g. a snapshot made from them)."""
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        self.rendered = self.model.format_chat(self.messages, False) if self.messages else ""
        self.cued = False

    def add(self, role: str, content: str) -> str:
        """Records a message; returns the text to queue for it."""
        return self._advance([*self.messages, {"role": role, "content": content}], cue=False)

    def cue(self) -> str:
        """Returns the text that starts the assistant's turn."""
        return self._advance(self.messages, cue=True)

    def _advance(self, messages: list[dict[str, str]], cue: bool) -> str:
        new = self.model.format_chat(messages, cue)
        if not new.startswith(self.rendered):
            what = "the cue" if cue else f"a {messages[-1]['role']} message"
            raise ValueError(
                f"the chat template renders the earlier messages differently once {what} "
                "follows, so the text to add cannot be told apart (a cue must be followed by "
                "generation before the next message); queue text yourself with ctx.fill()"
            )
        added = new[len(self.rendered) :]
        self.messages, self.rendered, self.cued = messages, new, cue
        return added

    def finish_turn(self, text: str) -> str | None:
        """After generating on a cue: records `text` as the assistant's message and returns the
        text the template puts after it to close the turn (None when no cue was pending, "" when
        the render does not continue the generated text)."""
        if not self.cued:
            return None
        messages = [*self.messages, {"role": "assistant", "content": text}]
        new = self.model.format_chat(messages, False)
        expected = self.rendered + text
        self.messages, self.rendered, self.cued = messages, new, False
        return new[len(expected) :] if new.startswith(expected) else ""
