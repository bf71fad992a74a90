"""How a command's failure reaches the operator: one line on stderr and an exit code (2: the
command line, the config or a file it names; 1: a failure while running), the traceback only
with `pie --debug`."""

from __future__ import annotations

import sys
import traceback

USAGE = 2
RUNTIME = 1

BUGS = (AssertionError, AttributeError, IndexError, KeyError, NameError, TypeError)
"""Exceptions that mean pie itself went wrong: told as such, with a pointer to --debug."""


def report(exc: BaseException, debug: bool) -> int:
    """Prints `exc` for the operator and returns the exit code."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    leaves = list(_leaves(exc))
    cause = leaves[0] if leaves else exc
    more = f" (and {len(leaves) - 1} more errors)" if len(leaves) > 1 else ""
    print(f"pie: {describe(cause, debug)}{more}", file=sys.stderr, flush=True)
    return exit_code(cause)


def describe(exc: BaseException, debug: bool = False) -> str:
    """One line: the exception's own words, its first line when it has several."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    text = " ".join(str(exc).split("\n", 1)[0].split())
    if isinstance(exc, BUGS) or not text:
        hint = "" if debug else " (pie --debug shows where)"
        return f"internal error: {type(exc).__name__}: {text or 'no message'}{hint}"
    return text


def exit_code(exc: BaseException) -> int:
    from pie.config import ConfigError

    usage = (ConfigError, FileNotFoundError, IsADirectoryError, PermissionError, ValueError)
    return USAGE if isinstance(exc, usage) else RUNTIME


def _leaves(exc: BaseException) -> list[BaseException]:
    """The errors inside nested exception groups (what trio's nurseries raise), in order."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
