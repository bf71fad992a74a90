"""The export of an HTTP-served inferlet: `handle(request)` runs the user's `async def handle`
on the inferlet loop and turns what it returned into the response."""

from __future__ import annotations

import sys

import main as _user  # the inferlet's main.py, imported when the component is built
from componentize_py_types import Err

from inferlet import _loop, serving
from inferlet._entry import describe


class WitWorld:
    def handle(self, request: object) -> object:
        try:
            result = _loop.run(_user.handle(serving.Request(request)))
            return serving.to_outgoing(result, serving.streamed())
        except serving.HttpError as exc:
            try:
                return serving.http_error(exc, serving.streamed())
            except BaseException as late:
                raise Err(describe(late)) from None
        except BaseException as exc:
            raise Err(describe(exc)) from None
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
