"""Incremental detokenization for generation runs, with the guest SDK's semantics
(sdk/python/inferlet/text.py): text is released once its characters are complete and it can no
longer be the start of a stop string; a stop string ends the text just before it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

Decode = Callable[[Sequence[int]], str]


class TextStream:
    def __init__(self, decode: Decode, stop_strings: Iterable[str] = ()) -> None:
        self._decode_ids = decode
        self.stops = tuple(s for s in stop_strings if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        """A stop string appeared; `text` ends just before it."""
        self._prefix = 0
        self._read = 0
        self._released = 0

    def push(self, token: int) -> None:
        """Adds a token. Each decode covers only the last few tokens: the window starts one
        release back, so tokenizers that drop a leading space at a window's start stay exact."""
        self.tokens.append(token)
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self.tokens))
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._extend(after[len(before) :])
            self._prefix, self._read = self._read, len(self.tokens)

    def finish(self) -> None:
        """Takes in whatever is left, incomplete characters included."""
        if not self.stopped and self._read < len(self.tokens):
            before = self._decode(self._prefix, self._read)
            self._extend(self._decode(self._prefix, len(self.tokens))[len(before) :])
            self._read = len(self.tokens)

    def release(self, final: bool = False) -> str:
        """Text not handed out yet; unless `final`, a tail that a stop string could still start
        with is held back."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        piece = self.text[self._released : end]
        self._released = max(self._released, end)
        return piece

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self.tokens[start:end]) if end > start else ""

    def _extend(self, piece: str) -> None:
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def _held(self) -> int:
        for size in range(min(len(self.text), self._longest), 0, -1):
            if any(s.startswith(self.text[-size:]) for s in self.stops):
                return size
        return 0
