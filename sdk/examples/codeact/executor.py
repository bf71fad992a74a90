"""Runs the model's Python inside this inferlet's own interpreter (CPython in the WebAssembly
sandbox), capturing what it prints and turning an exception into its traceback."""

from __future__ import annotations

import contextlib
import io
import linecache
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass
class Execution:
    output: str
    """What the code printed (stdout and stderr together), then the traceback if it failed."""
    failed: bool


class Executor:
    """Runs code in one namespace kept across calls, so later steps see earlier variables."""

    def __init__(self, max_output_chars: int = 2000) -> None:
        self.namespace: dict[str, Any] = {"__name__": "__agent__"}
        self.max_output_chars = max_output_chars

    def run(self, code: str, filename: str) -> Execution:
        # Registered so tracebacks quote the model's lines, as they do for a file.
        linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
        printed = io.StringIO()
        failed = False
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            try:
                exec(compile(code, filename, "exec"), self.namespace)
            except (Exception, SystemExit) as err:
                failed = True
                print(describe(err), end="")
        return Execution(self.clip(printed.getvalue()), failed)

    def clip(self, output: str) -> str:
        if len(output) <= self.max_output_chars:
            return output
        return output[: self.max_output_chars] + "\n... (output cut)\n"


def describe(err: BaseException) -> str:
    """The traceback from the model's code down, leaving out this module's own frame."""
    frames = err.__traceback__.tb_next if err.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(err), err, frames))
