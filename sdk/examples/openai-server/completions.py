"""`POST /completions`: the legacy Completions API. The prompt is raw text (or token ids), with
no chat template; `echo` returns it in front of the output, `logprobs` scores the output's (and
with `echo` the prompt's) tokens with the likeliest alternatives, as lm-eval's loglikelihood
requests expect."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import logprobs
from inferlet import Context, runtime, serving
from inferlet.serving import HttpError
from params import MAX_PROMPT_TOKENS, ApiError, Params, refuse_unsupported

FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logit_bias",
    "echo", "logprobs", "stream", "stream_options", "user", "ignore_eos", "presence_penalty",
    "frequency_penalty",
}  # fmt: skip
DEFAULT_MAX_TOKENS = 16
"""The API's own default for this endpoint."""


async def create(model: Any, body: dict[str, Any]) -> Any:
    refuse_unsupported(body, FIELDS)
    params = Params.of(
        body, length_keys=("max_tokens",), vocab_size=model.vocab_size, default=DEFAULT_MAX_TOKENS
    )
    prompt = _prompt(model, body.get("prompt"))
    echo, top = _echo_and_top(body)
    if body.get("stream") and (echo or top is not None):
        raise HttpError(400, "logprobs: echo and logprobs are returned whole, not with stream")
    head = {
        "id": f"cmpl-{runtime.instance_id()}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model.name,
    }
    with Context(model) as ctx:
        ctx.fill_tokens(prompt)
        generations = await params.choices(ctx, body)
        if body.get("stream"):
            await _stream(head, generations, len(prompt), body.get("stream_options") or {})
            return None
        texts = await asyncio.gather(*(g.collect_text() for g in generations))
    scored: list[Any] = [None] * len(generations)
    if top is not None:
        scored = await _scored(model, prompt, generations, top, echo)
    prefix = model.decode(prompt) if echo else ""
    choices = [
        {
            "text": prefix + text,
            "index": i,
            "logprobs": scored[i],
            "finish_reason": "length" if g.stop_reason == "length" else "stop",
        }
        for i, (text, g) in enumerate(zip(texts, generations, strict=True))
    ]
    return {**head, "choices": choices, "usage": _usage(len(prompt), generations)}


async def _scored(
    model: Any, prompt: list[int], generations: list[Any], top: int, echo: bool
) -> list[Any]:
    scores = await logprobs.score(model, prompt, [g.tokens for g in generations], top)
    if echo:
        return [logprobs.completion_logprobs(model, s, prompt[0], 0) for s in scores]
    offset = len(model.decode(prompt))
    tail = len(prompt) - 1
    return [logprobs.completion_logprobs(model, s[tail:], None, offset) for s in scores]


def _prompt(model: Any, given: Any) -> list[int]:
    """A string, or token ids; a list holding one of those is the same prompt."""
    if isinstance(given, list) and len(given) == 1 and isinstance(given[0], str | list):
        given = given[0]
    if isinstance(given, str) and given:
        tokens = model.encode(given)
    elif isinstance(given, list) and given and all(_is_token(t, model) for t in given):
        tokens = list(given)
    else:
        raise HttpError(400, "prompt: a non-empty string or list of token ids (one prompt)")
    if len(tokens) > MAX_PROMPT_TOKENS:
        raise ApiError(
            400,
            f"prompt: {len(tokens)} tokens, over the {MAX_PROMPT_TOKENS} this endpoint takes",
            code="context_length_exceeded",
        )
    return tokens


def _is_token(value: Any, model: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < model.vocab_size


def _echo_and_top(body: dict[str, Any]) -> tuple[bool, int | None]:
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise HttpError(400, "echo: true or false")
    top = body.get("logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 5):
        raise HttpError(400, f"logprobs: an integer from 0 to {logprobs.MAX_TOP_COMPLETIONS}")
    return echo, top


async def _stream(head: dict[str, Any], generations: list[Any], prompt: int, options: Any) -> None:
    if not isinstance(options, dict):
        raise HttpError(400, "stream_options: an object")
    stream = serving.respond(
        200, {"content-type": "text/event-stream", "cache-control": "no-cache"}
    )

    def chunk(index: int, text: str, finish: str | None) -> dict[str, Any]:
        choice = {"text": text, "index": index, "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [choice]}

    async def pump(index: int, generation: Any) -> None:
        async for piece in generation:
            stream.event(chunk(index, piece, None))
        finish = "length" if generation.stop_reason == "length" else "stop"
        stream.event(chunk(index, "", finish))

    await asyncio.gather(*(pump(i, g) for i, g in enumerate(generations)))
    if options.get("include_usage"):
        stream.event({**head, "choices": [], "usage": _usage(prompt, generations)})
    stream.write("data: [DONE]\n\n")


def _usage(prompt: int, generations: list[Any]) -> dict[str, int]:
    completion = sum(len(g.tokens) for g in generations)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
