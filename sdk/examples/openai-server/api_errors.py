"""The OpenAI API's error object, `{"error": {"message", "type", "param", "code"}}`: the type
follows the status, `param` names the request field at fault, `code` is stable for a program to
match on."""

from __future__ import annotations

import re
from typing import Any

from inferlet.serving import HttpError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
"""The error type of each client status; every 5xx is a `server_error`."""

FIELD = re.compile(r"[A-Za-z_]\w*(?:\.\w+|\[\d+\])*")
"""A request field as messages name it: `temperature`, `messages[0].content[1].image_url`."""


class ApiError(HttpError):
    """An HttpError with its OpenAI code (and the field at fault, when its message does not
    start with it)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(status, message)
        self.code = code
        self.param = param


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else TYPES.get(status, "invalid_request_error")


def error_body(error: HttpError) -> dict[str, Any]:
    """The error object; `param` is the field the message starts with (`field: why`) unless
    the error names it, and an error without a code gets its status's."""
    param = getattr(error, "param", None) or _field_of(error.message)
    code = getattr(error, "code", None) or _default_code(error.status, param)
    return {
        "error": {
            "message": error.message,
            "type": error_type(error.status),
            "param": param,
            "code": code,
        }
    }


def _field_of(message: str) -> str | None:
    field, sep, _ = message.partition(": ")
    return field if sep and FIELD.fullmatch(field) else None


def _default_code(status: int, param: str | None) -> str:
    if status >= 500:
        return "server_error"
    if status == 404:
        return "not_found"
    if status == 429:
        return "rate_limit_exceeded"
    return "invalid_value" if param else "invalid_request"
