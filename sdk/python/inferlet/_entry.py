"""The component's export: `run(input)` parses the input, runs the user's `async def main` on
the inferlet loop, and returns its result (JSON unless it is a string) or a readable error."""

from __future__ import annotations

import inspect
import json
import sys
import traceback
from typing import Any

import main as _user  # the inferlet's main.py, imported when the component is built
from componentize_py_types import Err

from inferlet import _loop

_SDK_FILES = ("/asyncio/", "inferlet/_entry.py", "inferlet/_loop.py")
_USER_ROOT = "/0/"


class WitWorld:
    def run(self, input: str) -> str:
        try:
            result = _loop.run(_call_main(_parse(input)))
            return result if isinstance(result, str) else _to_json(result)
        except BaseException as exc:
            raise Err(describe(exc)) from None
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


async def _call_main(value: Any) -> Any:
    takes_input = bool(inspect.signature(_user.main).parameters)
    return await (_user.main(value) if takes_input else _user.main())


def _to_json(result: Any) -> str:
    try:
        return json.dumps(result)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"main returned a {type(result).__name__}, which is neither a str nor JSON ({err})"
        ) from None


def describe(exc: BaseException) -> str:
    """`Type: message` and the last frames of the user's own code."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not any(part in f.filename for part in _SDK_FILES)
    ]
    for frame in frames:
        # componentize-py mounts the inferlet's folder at /0: show paths as the user wrote them.
        frame.filename = frame.filename.removeprefix(_USER_ROOT)
    message = str(exc)
    lines = [f"{type(exc).__name__}: {message}" if message else type(exc).__name__]
    if frames:
        lines.append("Traceback (most recent call last):")
        lines.extend(line.rstrip("\n") for line in traceback.format_list(frames[-6:]))
    return "\n".join(lines)
