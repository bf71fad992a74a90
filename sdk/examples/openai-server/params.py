"""What the OpenAI request bodies share: messages in the chat template's shape, sampling and
length parameters, each checked with a 400 that names the bad field."""

from __future__ import annotations

from typing import Any

from inferlet import Context, Sampler
from inferlet.serving import HttpError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_TOKENS = 4096
DEFAULT_MAX_TOKENS = 256
MAX_PROMPT_TOKENS = 32768
"""Prompts are counted before anything runs; a longer one is refused (context_length_exceeded)."""


class Params:
    def __init__(
        self, sampler: Sampler, max_tokens: int, stop: list[str], ignore_eos: bool = False
    ) -> None:
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stop = stop
        self.ignore_eos = ignore_eos
        """An extension (as in vLLM): go on past the model's stop tokens."""

    @classmethod
    def of(cls, body: dict[str, Any], *, length_keys: tuple[str, ...]) -> Params:
        if body.get("n", 1) != 1:
            raise HttpError(400, "n: only 1 choice per request is supported")
        length = next((body[k] for k in length_keys if body.get(k) is not None), None)
        max_tokens = DEFAULT_MAX_TOKENS if length is None else _int(length_keys[0], length)
        if not 1 <= max_tokens <= MAX_TOKENS:
            raise HttpError(400, f"{length_keys[0]}: must be 1 to {MAX_TOKENS}")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise HttpError(400, "ignore_eos: true or false")
        return cls(_sampler(body), max_tokens, _stops(body.get("stop")), ignore_eos)

    def generate(self, ctx: Context) -> Any:
        return ctx.generate(
            self.sampler,
            max_tokens=self.max_tokens,
            stop_strings=self.stop,
            stop_tokens=[] if self.ignore_eos else None,
        )


def _sampler(body: dict[str, Any]) -> Sampler:
    temperature = _number("temperature", body.get("temperature", 1.0), 0.0, 2.0)
    top_p = _number("top_p", body.get("top_p", 1.0), 0.0, 1.0)
    seed = body.get("seed")
    if seed is not None:
        seed = _int("seed", seed) % (1 << 63)
    if temperature == 0:
        return Sampler.argmax()
    if top_p < 1.0:
        return Sampler.top_p(top_p, temperature=temperature, seed=seed)
    return Sampler.multinomial(temperature=temperature, seed=seed)


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise HttpError(400, "stop: a string or a list of strings")
    if len(stops) > 4:
        raise HttpError(400, "stop: at most 4 sequences")
    return stops


def chat_messages(messages: Any, field: str = "messages") -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, f"{field}: a non-empty list of messages")
    return [_message(m, f"{field}[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise HttpError(400, f"{where}: a message is an object with role and content")
    given = message.get("role")
    role = ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise HttpError(400, f"{where}.role: one of {', '.join(ROLES)}")
    return {"role": role, "content": text_of(message.get("content"), f"{where}.content")}


def prompt_tokens(model: Any, messages: list[dict[str, str]], field: str) -> list[int]:
    """The chat prompt's tokens, counted before any pass runs."""
    tokens = model.encode(model.format_chat(messages, True))
    if len(tokens) > MAX_PROMPT_TOKENS:
        raise ApiError(
            400,
            f"{field}: the prompt is {len(tokens)} tokens, over the {MAX_PROMPT_TOKENS} this"
            " endpoint takes",
            code="context_length_exceeded",
        )
    return tokens


class ApiError(HttpError):
    """An HttpError that names its OpenAI error code."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(status, message)
        self.code = code


def error_body(error: HttpError) -> dict[str, Any]:
    """The OpenAI API's error object: `param` is the field the message starts with."""
    field, sep, _ = error.message.partition(": ")
    param = field if sep and " " not in field else None
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    code = getattr(error, "code", None)
    return {"error": {"message": error.message, "type": kind, "param": param, "code": code}}


def text_of(content: Any, where: str) -> str:
    """Plain text, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise HttpError(400, f"{where}: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise HttpError(400, f"{where}: a string or a list of text parts")


def _number(field: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise HttpError(400, f"{field}: a number from {low:g} to {high:g}")
    return float(value)


def _int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{field}: an integer")
    return value
