"""What the OpenAI request bodies share: messages in the chat template's shape (their media parts
marked, see content.py), sampling, length and output-format parameters, each checked with a 400
that names the bad field. A field this server does not support is refused by name unless it
asks for the API's default behaviour."""

from __future__ import annotations

from typing import Any

from api_errors import ApiError
from content import content_of
from inferlet import Context, Grammar, HostError, Sampler
from inferlet.serving import HttpError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_TOKENS = 4096
DEFAULT_MAX_TOKENS = 256
MAX_PROMPT_TOKENS = 32768
"""Prompts are counted before anything runs; a longer one is refused (context_length_exceeded)."""
MAX_CHOICES = 16
"""`n` at most: each choice is a branch forked off the one prefilled prompt."""

CHAT_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
    "stop", "stream", "stream_options", "n", "response_format", "ignore_eos", "user",
    "logit_bias", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "tools",
    "tool_choice", "parallel_tool_calls", "modalities", "audio",
}  # fmt: skip
RESPONSES_FIELDS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed",
    "stream", "text", "user",
}  # fmt: skip
DEFAULTS: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "metadata": ({},),
    "store": (False,),
    "best_of": (1,),
    "suffix": ("",),
    # SGLang's own fields, which the SGLang router (sglang-router 0.3.2) writes with these values
    # into every request it forwards, whatever the client sent.
    "no_stop_trim": (False,),
    "continue_final_message": (False,),
    "skip_special_tokens": (True,),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
    "return_hidden_states": (False,),
}
"""Fields not supported yet, accepted only with the value that asks for the default behaviour."""


def refuse_unsupported(
    body: dict[str, Any], supported: set[str], defaults: dict[str, tuple[Any, ...]] = DEFAULTS
) -> None:
    """A 400 naming the first field this server would otherwise have to ignore."""
    for field, value in body.items():
        if field in supported or value is None or value in defaults.get(field, ()):
            continue
        raise ApiError(400, f"{field}: not supported by this server", "unsupported_parameter")


class Params:
    def __init__(
        self,
        sampler: Sampler,
        max_tokens: int,
        stop: list[str],
        ignore_eos: bool = False,
        schema: dict[str, Any] | None = None,
        n: int = 1,
        logit_bias: list[tuple[list[int], float]] | None = None,
    ) -> None:
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stop = stop
        self.ignore_eos = ignore_eos
        """An extension (as in vLLM): go on past the model's stop tokens."""
        self.schema = schema
        """The JSON Schema the output must validate against (response_format)."""
        self.n = n
        self.format_field = "response_format"
        self.logit_bias = logit_bias or []
        """(run-length mask, value) pairs: OpenAI's `logit_bias`, one pair per distinct value."""
        self.penalties = (0.0, 0.0)
        """`presence_penalty` and `frequency_penalty`, applied by the engine at every step."""
        self.grammar: Grammar | None = None
        """The reply's grammar when tools are offered (it replaces `schema`)."""

    @classmethod
    def of(
        cls,
        body: dict[str, Any],
        *,
        length_keys: tuple[str, ...],
        vocab_size: int = 0,
        default: int = DEFAULT_MAX_TOKENS,
    ) -> Params:
        n = _int("n", body.get("n", 1))
        if not 1 <= n <= MAX_CHOICES:
            raise HttpError(400, f"n: 1 to {MAX_CHOICES} choices")
        length = next((body[k] for k in length_keys if body.get(k) is not None), None)
        max_tokens = default if length is None else _int(length_keys[0], length)
        if not 1 <= max_tokens <= MAX_TOKENS:
            raise HttpError(400, f"{length_keys[0]}: must be 1 to {MAX_TOKENS}")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise HttpError(400, "ignore_eos: true or false")
        stops = _stops(body.get("stop"))
        params = cls(_sampler(body, 0), max_tokens, stops, ignore_eos, _schema(body), n)
        params.logit_bias = _logit_bias(body.get("logit_bias"), vocab_size)
        params.penalties = tuple(
            _number(name, body.get(name, 0.0), -2.0, 2.0)
            for name in ("presence_penalty", "frequency_penalty")
        )
        params.format_field = "text.format" if "text" in body else "response_format"
        return params

    async def choices(self, ctx: Context, body: dict[str, Any]) -> list[Any]:
        """One generation per choice. With n > 1 the prompt is prefilled once and each choice
        is a branch forked off it (sharing its KV pages), drawing with `seed + index`."""
        if self.n == 1:
            return [self.generate(ctx, self.sampler)]
        await ctx.flush()
        return [self.generate(ctx.fork(), _sampler(body, i)) for i in range(self.n)]

    def generate(self, ctx: Context, sampler: Sampler) -> Any:
        try:
            return ctx.generate(
                sampler,
                max_tokens=self.max_tokens,
                stop_strings=self.stop,
                stop_tokens=[] if self.ignore_eos else None,
                schema=None if self.grammar else self.schema,
                grammar=self.grammar,
                logit_bias=self.logit_bias,
                presence_penalty=self.penalties[0],
                frequency_penalty=self.penalties[1],
            )
        except HostError as error:
            if error.kind == "invalid" and self.schema is not None:
                raise HttpError(400, f"{self.format_field}: {error.message}") from None
            raise


def _sampler(body: dict[str, Any], choice: int) -> Sampler:
    temperature = _number("temperature", body.get("temperature", 1.0), 0.0, 2.0)
    top_p = _number("top_p", body.get("top_p", 1.0), 0.0, 1.0)
    seed = body.get("seed")
    if seed is not None:
        seed = (_int("seed", seed) + choice) % (1 << 63)
    if temperature == 0:
        return Sampler.argmax()
    if top_p < 1.0:
        return Sampler.top_p(top_p, temperature=temperature, seed=seed)
    return Sampler.multinomial(temperature=temperature, seed=seed)


MAX_BIASED_TOKENS = 300


def _logit_bias(given: Any, vocab_size: int) -> list[tuple[list[int], float]]:
    """`{"token id": bias}` (bias -100 to 100) as one run-length mask per distinct bias."""
    if given is None:
        return []
    if not isinstance(given, dict) or len(given) > MAX_BIASED_TOKENS:
        raise HttpError(400, f"logit_bias: an object of at most {MAX_BIASED_TOKENS} token ids")
    by_value: dict[float, list[int]] = {}
    for key, value in given.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise HttpError(400, f"logit_bias: {key!r} is not a token id below {vocab_size}")
        by_value.setdefault(_number("logit_bias", value, -100, 100), []).append(token)
    return [(_runs(sorted(tokens), vocab_size), v) for v, tokens in by_value.items() if v]


def _runs(tokens: list[int], vocab_size: int) -> list[int]:
    """Run lengths selecting exactly `tokens` (sorted, distinct) out of the vocabulary."""
    runs, cursor = [0], 0
    for token in tokens:
        if runs[-1] and token == cursor:
            runs[-1] += 1
        else:
            runs += [token - cursor, 1]
        cursor = token + 1
    runs.append(vocab_size - cursor)
    return runs


def _schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """The schema that `response_format` (Chat Completions) or `text.format` (Responses) asks
    for: any JSON object for `json_object`, the given schema for `json_schema`."""
    if "text" in body:
        text = body["text"]
        if text is None:
            return None
        if not isinstance(text, dict) or set(text) - {"format"}:
            raise HttpError(400, "text: an object with `format`")
        return _format_schema(text.get("format"), "text.format", nested=False)
    return _format_schema(body.get("response_format"), "response_format", nested=True)


def _format_schema(fmt: Any, field: str, *, nested: bool) -> dict[str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise HttpError(400, f"{field}: type text, json_object or json_schema")
    spec = fmt.get("json_schema") if nested else fmt
    where = f"{field}.json_schema" if nested else field
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise HttpError(400, f"{where}: an object with a `name` and a `schema`")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise HttpError(400, f"{where}.schema: a JSON Schema object")
    # strict or not, the output is held to the schema.
    return schema


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise HttpError(400, "stop: a string or a list of strings")
    if len(stops) > 4:
        raise HttpError(400, "stop: at most 4 sequences")
    return stops


def chat_messages(messages: Any, field: str = "messages") -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, f"{field}: a non-empty list of messages")
    return [message(m, f"{field}[{i}]") for i, m in enumerate(messages)]


def message(given: Any, where: str) -> dict[str, Any]:
    """One message with a role the chat template knows; its content's media (`media`) are
    marked in its text where they stand."""
    if not isinstance(given, dict):
        raise HttpError(400, f"{where}: a message is an object with role and content")
    named = given.get("role")
    role = ROLES.get(named) if isinstance(named, str) else None
    if role is None:
        raise HttpError(400, f"{where}.role: one of {', '.join(ROLES)}")
    text, media = content_of(given.get("content"), f"{where}.content")
    return {"role": role, "content": text, "media": media}


def text_of(content: Any, where: str) -> str:
    """Plain text, or the text parts of a list of content parts (no media)."""
    text, media = content_of(content, where)
    if media:
        raise HttpError(400, f"{media[0].where}: only text parts are supported here")
    return text


def _number(field: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise HttpError(400, f"{field}: a number from {low:g} to {high:g}")
    return float(value)


def _int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{field}: an integer")
    return value
