"""Chat state of a context: the messages so far and their render, so each chat call queues
exactly the text the model's template adds for it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from inferlet.media import Media
from inferlet.model import Message, Model

Content = str | Sequence[str | Media]
"""A chat message's content: text, or text and media in the order the message holds them."""

_OPEN, _CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_OPEN}(image|video|audio){_CLOSE}")


def chat_content(content: Content) -> tuple[str, list[Media]]:
    """The message text the host renders, each medium marked by a sentinel the host turns into
    a typed content part, and the media in order."""
    if isinstance(content, str):
        return content, []
    text, media = [], []
    for part in content:
        if isinstance(part, Media):
            text.append(f"{_OPEN}{part.kind}{_CLOSE}")
            media.append(part)
        elif isinstance(part, str):
            text.append(part)
        else:
            raise TypeError(f"a message part is text or media, not {type(part).__name__}")
    return "".join(text), media


def split_rendered(rendered: str, media: list[Media]) -> list[str | Media]:
    """The rendered text a message adds, cut where the template placed its media."""
    kinds = _MARK.findall(rendered)
    if kinds != [m.kind for m in media]:
        raise ValueError(
            f"the chat template placed {kinds} where the message holds {[m.kind for m in media]}"
        )
    pieces: list[str | Media] = []
    for text, item in zip(_MARK.split(rendered)[::2], [*media, None], strict=True):
        pieces.append(text)
        if item is not None:
            pieces.append(item)
    return pieces


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
