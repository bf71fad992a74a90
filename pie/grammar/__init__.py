"""Constrained decoding in the engine: grammars compiled by llguidance, cached by content, and
matchers that give each step's token mask as run lengths (see engine.py)."""

from pie.grammar.engine import (
    KINDS,
    Grammar,
    GrammarError,
    GrammarLimits,
    Grammars,
    GrammarStatistics,
    Matcher,
)
from pie.grammar.masks import bitmask_to_rle, intersect

__all__ = [
    "KINDS",
    "Grammar",
    "GrammarError",
    "GrammarLimits",
    "GrammarStatistics",
    "Grammars",
    "Matcher",
    "bitmask_to_rle",
    "intersect",
]
