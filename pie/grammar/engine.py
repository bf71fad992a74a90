"""Grammars for constrained decoding, compiled by llguidance for one model's tokenizer and
cached by content; every matcher starts as a copy of a cached compiled one, so a schema that
many requests share is compiled once."""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from attrs import frozen

from pie.events.sampling import Rle
from pie.grammar.masks import bitmask_to_rle

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json-schema", "any-json", "regex", "lark", "ebnf")
JSON_DEFAULTS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
"""JSON comes out on one line with a space after `,` and `:`, the spacing models write and a
bounded output needs (flexible whitespace lets a small model pad forever). A schema's own
`x-guidance` options override these."""


class GrammarError(ValueError):
    """A grammar that does not compile, a token it refuses, or a bound reached: `kind` is the
    error word programs see (`invalid` or `quota`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@frozen(kw_only=True)
class GrammarLimits:
    max_source_bytes: int = 256 << 10
    """The largest grammar source (schema, regex, Lark or EBNF text) accepted."""
    cache_entries: int = 256
    """Compiled grammars kept for reuse, the least recently used dropped first."""
    max_matchers_per_user: int = 1024
    """Live matchers one user may hold across all their inferlets."""


@frozen(kw_only=True)
class GrammarStatistics:
    compiled: int
    cache_hits: int
    cached: int
    live_matchers: int
    masks: int
    mask_seconds: float
    """Time spent computing next-token masks, over `masks` masks."""


class Grammar:
    """A compiled grammar: a matcher in its start state that is only ever copied."""

    def __init__(self, key: str, kind: str, template: Any) -> None:
        self.key = key
        self.kind = kind
        self._template = template
        self._lock = threading.Lock()

    def copy_matcher(self) -> Any:
        with self._lock:
            return self._template.deep_copy()


def grammar_text(kind: str, source: str) -> str:
    """llguidance's grammar for a source of one of the KINDS."""
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    match kind:
        case "json-schema":
            try:
                schema = json.loads(source)
            except json.JSONDecodeError as exc:
                raise GrammarError("invalid", f"the JSON schema is not JSON: {exc}") from None
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise GrammarError("invalid", "a JSON schema is an object (or true)")
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_DEFAULTS))
        case "any-json":
            return str(llguidance.LLMatcher.grammar_from_json_schema({}, JSON_DEFAULTS))
        case "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(source))
        case "lark":
            return str(llguidance.LLMatcher.grammar_from_lark(source))
        case "ebnf":
            try:
                lark = gbnf_to_lark(source)
            except Exception as exc:  # the converter raises plain exceptions on bad input
                raise GrammarError("invalid", f"the EBNF grammar does not parse: {exc}") from None
            return str(llguidance.LLMatcher.grammar_from_lark(lark))
    raise GrammarError("invalid", f"no grammar kind {kind!r}; the kinds are {', '.join(KINDS)}")


class Grammars:
    """One model's grammar engine: its llguidance tokenizer (built on first use), the cache of
    compiled grammars, and the count of live matchers per user."""

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        stop_tokens: Sequence[int],
        limits: GrammarLimits | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self._tokenizer_json = tokenizer_json
        self._stop_tokens = sorted(stop_tokens)
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        self._per_user: collections.Counter[str] = collections.Counter()
        self._compiled = 0
        self._hits = 0
        self._masks = 0
        self._mask_seconds = 0.0

    def compile(self, kind: str, source: str) -> Grammar:
        """The compiled grammar for a source, from the cache when the same kind and text were
        compiled before; a bad grammar raises GrammarError with llguidance's message."""
        if len(source.encode()) > self.limits.max_source_bytes:
            raise GrammarError(
                "invalid", f"the grammar source is over {self.limits.max_source_bytes} bytes"
            )
        key = hashlib.sha256(f"{kind}\0{source}".encode()).hexdigest()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return cached
        grammar = Grammar(key, kind, self._build(grammar_text(kind, source)))
        with self._lock:
            self._compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > self.limits.cache_entries:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: Grammar, user: str) -> Matcher:
        """A matcher in the grammar's start state, counted against `user` until closed."""
        with self._lock:
            if self._per_user[user] >= self.limits.max_matchers_per_user:
                raise GrammarError(
                    "quota",
                    f"user {user!r} holds {self.limits.max_matchers_per_user} matchers already",
                )
            self._per_user[user] += 1
        return Matcher(grammar.copy_matcher(), self.vocab_size, self, user)

    def statistics(self) -> GrammarStatistics:
        with self._lock:
            return GrammarStatistics(
                compiled=self._compiled,
                cache_hits=self._hits,
                cached=len(self._cache),
                live_matchers=sum(self._per_user.values()),
                masks=self._masks,
                mask_seconds=self._mask_seconds,
            )

    def _build(self, text: str) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise GrammarError("invalid", f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self._stop_tokens
                )
            return self._tokenizer

    def _closed(self, user: str) -> None:
        with self._lock:
            self._per_user[user] -= 1
            if self._per_user[user] <= 0:
                del self._per_user[user]

    def _timed_mask(self, seconds: float) -> None:
        with self._lock:
            self._masks += 1
            self._mask_seconds += seconds


class Matcher:
    """Where a generation stands in a grammar: the tokens allowed next, and the tokens taken.

    A generation run that holds the matcher (`claim`) is its only user until it ends; the
    program's own calls are refused meanwhile."""

    def __init__(self, ll: Any, vocab_size: int, owner: Grammars, user: str) -> None:
        self._ll = ll
        self.vocab_size = vocab_size
        self._owner = owner
        self._user = user
        self._mask: Rle | None = None
        self._claimed = False
        self._closed = False
        self._lock = threading.Lock()

    def mask(self) -> Rle:
        """Run lengths over the vocabulary of the tokens the grammar allows next (only the stop
        tokens once the grammar is complete)."""
        self._check()
        if self._mask is None:
            started = time.perf_counter()
            bitmask = self._ll.compute_bitmask()
            self._mask = bitmask_to_rle(bitmask, self.vocab_size)
            self._owner._timed_mask(time.perf_counter() - started)
        return self._mask

    def consume(self, tokens: Sequence[int]) -> int:
        """Takes tokens in order while the grammar allows them; how many it took."""
        self._check()
        taken = int(self._ll.try_consume_tokens(list(tokens)))
        if taken:
            self._mask = None
        return taken

    def rollback(self, count: int) -> None:
        """Forgets the last `count` tokens taken."""
        self._check()
        if count < 0 or not self._ll.rollback(count):
            raise GrammarError("invalid", f"cannot roll back {count} tokens")
        self._mask = None

    def forced(self) -> list[int]:
        """Tokens the grammar allows no alternative to, from here."""
        self._check()
        return [int(t) for t in self._ll.compute_ff_tokens()]

    @property
    def accepting(self) -> bool:
        """Whether what was taken so far is a complete sentence of the grammar."""
        return bool(self._ll.is_accepting())

    @property
    def stopped(self) -> bool:
        """Whether the grammar admits nothing more (only a stop token)."""
        return bool(self._ll.is_stopped())

    def claim(self) -> None:
        """Hands the matcher to a generation run until `release`."""
        with self._lock:
            self._check()
            if self._claimed:
                raise GrammarError("busy", "the matcher is driving a generation run")
            self._claimed = True

    def release(self) -> None:
        with self._lock:
            self._claimed = False

    @property
    def claimed(self) -> bool:
        return self._claimed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._owner._closed(self._user)

    def _check(self) -> None:
        if self._closed:
            raise GrammarError("invalid", "the matcher was freed")
        if self._ll.is_error():
            raise GrammarError("invalid", f"the matcher failed: {self._ll.get_error()}")
