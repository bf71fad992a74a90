"""Token masks between the forms the grammar engine and a forward pass speak: llguidance's
bitmask (one bit per token, little-endian words) and the pass's run lengths (`Rle`)."""

from __future__ import annotations

import numpy as np

from pie.events.sampling import Rle


def bitmask_to_rle(bitmask: bytes, vocab_size: int) -> Rle:
    """The run lengths of a bitmask over the first `vocab_size` tokens (bits past the mask's
    end count as not allowed)."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    if bits.size < vocab_size:
        bits = np.concatenate((bits, np.zeros(vocab_size - bits.size, dtype=np.uint8)))
    return bools_to_runs(bits[:vocab_size])


def bools_to_runs(allowed: np.ndarray) -> Rle:
    """The run lengths of a boolean (or 0/1) vector, starting with a run of allowed tokens."""
    flags = allowed.view(np.uint8) if allowed.dtype == np.bool_ else allowed
    edges = np.flatnonzero(flags[1:] != flags[:-1]) + 1
    bounds = np.empty(edges.size + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, flags.size
    bounds[1:-1] = edges
    runs: list[int] = np.diff(bounds).tolist()
    if flags.size and not flags[0]:
        runs.insert(0, 0)
    return tuple(runs)


def runs_to_bools(runs: Rle, vocab_size: int) -> np.ndarray:
    """The boolean vector of run lengths over `vocab_size` tokens."""
    counts = np.asarray(runs, dtype=np.int64)
    if counts.size == 0 or (counts < 0).any() or int(counts.sum()) != vocab_size:
        raise ValueError(f"mask runs must be >= 0 and add up to {vocab_size}")
    values = np.arange(counts.size) % 2 == 0
    return np.repeat(values, counts)


def intersect(a: Rle | None, b: Rle | None, vocab_size: int) -> Rle | None:
    """Tokens both masks allow (None allows every token)."""
    if a is None:
        return b
    if b is None:
        return a
    return bools_to_runs(runs_to_bools(a, vocab_size) & runs_to_bools(b, vocab_size))
