"""An instance's grammars and matchers, by handle: bounded per inferlet (and, through the
model's grammar engine, per user), and freed when the inferlet ends."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from pie.grammar import Grammar, GrammarError, Grammars, Matcher
from pie.sandbox.host.failure import HostFailure


class MatcherTable:
    def __init__(self, user: str, max_matchers: int, new_handle: Callable[[], int]) -> None:
        self._user = user
        self._max_matchers = max_matchers
        self._new_handle = new_handle
        self._lock = threading.Lock()
        self._grammars: dict[int, tuple[Grammars, Grammar]] = {}
        self._matchers: dict[int, Matcher] = {}

    def add_grammar(self, engine: Grammars, grammar: Grammar) -> int:
        """A handle on a compiled grammar (the compiled form lives in the engine's cache; a
        handle costs nothing, but a program holds at most as many as it may hold matchers)."""
        with self._lock:
            if len(self._grammars) >= self._max_matchers:
                raise HostFailure("quota", f"at most {self._max_matchers} grammars per inferlet")
            handle = self._new_handle()
            self._grammars[handle] = (engine, grammar)
        return handle

    def new_matcher(self, grammar: int) -> int:
        with self._lock:
            entry = self._grammars.get(grammar)
            if entry is None:
                raise HostFailure("no-such-handle", f"no grammar {grammar}")
            if len(self._matchers) >= self._max_matchers:
                raise HostFailure("quota", f"at most {self._max_matchers} matchers per inferlet")
            engine, compiled = entry
            with grammar_errors():
                matcher = engine.matcher(compiled, self._user)
            handle = self._new_handle()
            self._matchers[handle] = matcher
        return handle

    def matcher(self, handle: int) -> Matcher:
        with self._lock:
            matcher = self._matchers.get(handle)
        if matcher is None:
            raise HostFailure("no-such-handle", f"no matcher {handle}")
        return matcher

    def for_program(self, handle: int) -> Matcher:
        """A matcher the program itself may step (not while a generation run drives it)."""
        matcher = self.matcher(handle)
        if matcher.claimed:
            raise HostFailure("busy", f"matcher {handle} is driving a generation run")
        return matcher

    def free(self, handle: int) -> None:
        """Forgets a grammar or matcher handle (a run driving a freed matcher carries on)."""
        with self._lock:
            self._grammars.pop(handle, None)
            matcher = self._matchers.pop(handle, None)
        if matcher is not None:
            matcher.close()

    def close_all(self) -> None:
        with self._lock:
            matchers = list(self._matchers.values())
            self._matchers.clear()
            self._grammars.clear()
        for matcher in matchers:
            matcher.close()


@contextlib.contextmanager
def grammar_errors() -> Iterator[None]:
    """Turns the grammar engine's errors into the program's."""
    try:
        yield
    except GrammarError as exc:
        raise HostFailure(exc.kind, str(exc)) from None
