"""The errors media decoding raises: every decoder turns what pillow and av raise on bad
input into one of these, so a caller handles a single family (`MediaError`, a ValueError)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

_COMPLAINT_CHARS = 300


class MediaError(ValueError):
    """Media a program or client sent that the engine will not decode."""


class MediaTooLarge(MediaError):
    """Over one of the [media] limits: bytes, pixels, duration or frames."""

    def __init__(self, kind: str, *, key: str, limit: float, value: float, unit: str) -> None:
        super().__init__(
            f"{kind} too large: {_number(value)} {unit}, over [media] {key} = {_number(limit)}"
        )
        self.kind, self.key, self.limit, self.value = kind, key, limit, value


class UnsupportedMedia(MediaError):
    """A format or codec that is unknown, or known and not allowed."""

    def __init__(self, kind: str, *, detected: str, allowed: Iterable[str]) -> None:
        super().__init__(f"unsupported {kind}: {detected} (allowed: {', '.join(allowed)})")
        self.kind, self.detected = kind, detected


class CorruptMedia(MediaError):
    """A format the decoder knows whose content it cannot decode."""

    def __init__(self, kind: str, complaint: str) -> None:
        super().__init__(f"corrupt {kind}: {one_line(complaint)}")
        self.kind = kind


def one_line(text: str) -> str:
    """`text` with its whitespace runs as single spaces, cut to a few hundred characters."""
    flat = re.sub(r"\s+", " ", text).strip()
    return flat if len(flat) <= _COMPLAINT_CHARS else flat[: _COMPLAINT_CHARS - 3] + "..."


@contextmanager
def decoder_errors(kind: str) -> Iterator[None]:
    """Turns anything a decoder raises on bad input into CorruptMedia.

    pillow and av raise many types on malformed data (OSError, SyntaxError, struct.error,
    EOFError, av's FFmpegErrors, warnings promoted to errors...), so the boundary is
    Exception; MediaErrors pass as they are, and MemoryError is not about the input's form."""
    try:
        yield
    except (MediaError, MemoryError):
        raise
    except Exception as exc:
        raise CorruptMedia(kind, complaint(exc)) from exc


def complaint(exc: BaseException) -> str:
    """The exception's type and reason (av's without the errno and file name around it)."""
    reason = getattr(exc, "strerror", None) or str(exc) or "no reason given"
    return f"{type(exc).__name__}: {reason}"


def check_bytes(kind: str, data: bytes, *, key: str, limit_mb: int) -> None:
    """Refuses `data` longer than `limit_mb` MiB, before anything reads it."""
    if len(data) > limit_mb << 20:
        size = len(data) / (1 << 20)
        raise MediaTooLarge(
            kind, key=key, limit=limit_mb, value=round(size, 2), unit=f"MiB ({len(data)} bytes)"
        )


def check_pixels(kind: str, width: int, height: int, *, key: str, limit: int) -> None:
    """Refuses a picture or frame of more than `limit` pixels."""
    if width * height > limit:
        raise MediaTooLarge(
            kind, key=key, limit=limit, value=width * height, unit=f"pixels ({width}x{height})"
        )


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
