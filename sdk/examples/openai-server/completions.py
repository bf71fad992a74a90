"""`POST /completions`: the legacy Completions API. The prompt is raw text (or token ids), with
no chat template; `echo` returns it in front of the output, `logprobs` scores the output's (and
with `echo` the prompt's) tokens with the likeliest alternatives, as lm-eval's loglikelihood
requests expect; streamed, each chunk carries the logprobs of its own tokens."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import logprobs
from api_errors import ApiError
from inferlet import Context, runtime, serving
from inferlet.serving import HttpError
from params import MAX_PROMPT_TOKENS, Params, refuse_unsupported

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
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HttpError(400, "stream_options: an object")
    head = {
        "id": f"cmpl-{runtime.instance_id()}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model.name,
    }
    with Context(model) as ctx:
        ctx.fill_tokens(prompt)
        if top is not None:
            await ctx.flush()  # the scorers fork the prefilled prompt
        generations = await params.choices(ctx, body)
        scorers = [] if top is None else [logprobs.Scorer(ctx, top) for _ in generations]
        try:
            opening = await _opening(model, prompt, echo, top)
            if body.get("stream"):
                await _stream(model, head, generations, scorers, opening, len(prompt), options)
                return None
            texts = await asyncio.gather(*(g.collect_text() for g in generations))
            scores = await logprobs.finished(scorers, generations) if scorers else None
        finally:
            for scorer in scorers:
                scorer.close()
    choices = [
        _choice(model, i, text, g, scores, opening)
        for i, (text, g) in enumerate(zip(texts, generations, strict=True))
    ]
    return {**head, "choices": choices, "usage": _usage(len(prompt), generations)}


def _choice(
    model: Any,
    index: int,
    text: str,
    generation: Any,
    scores: list[Any] | None,
    opening: tuple[str, Any, int],
) -> dict[str, Any]:
    echoed, scored, offset = opening
    shaped = None
    if scores is not None:
        shaped = logprobs.completion_logprobs(model, scores[index], None, offset)
        shaped = shaped if scored is None else logprobs.joined(scored, shaped)
    finish = "length" if generation.stop_reason == "length" else "stop"
    return {"text": echoed + text, "index": index, "logprobs": shaped, "finish_reason": finish}


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


async def _opening(
    model: Any, prompt: list[int], echo: bool, top: int | None
) -> tuple[str, Any, int]:
    """What a streamed choice starts with: the echoed prompt and its logprobs, and where the
    output's text offsets begin."""
    text = model.decode(prompt)
    if not echo or top is None:
        return (text if echo else ""), None, len(text)
    scores = await logprobs.prompt_scores(model, prompt, top)
    scored = logprobs.completion_logprobs(model, scores, prompt[0], 0)
    return text, scored, _end(scored, 0)


def _end(scored: dict[str, Any], offset: int) -> int:
    """The text offset just past a logprobs object's last token."""
    if not scored["tokens"]:
        return offset
    return int(scored["text_offset"][-1]) + len(scored["tokens"][-1])


async def _stream(
    model: Any,
    head: dict[str, Any],
    generations: list[Any],
    scorers: list[logprobs.Scorer],
    opening: tuple[str, Any, int],
    prompt: int,
    options: dict[str, Any],
) -> None:
    stream = serving.respond(
        200, {"content-type": "text/event-stream", "cache-control": "no-cache"}
    )

    def chunk(index: int, text: str, finish: str | None, scored: Any) -> dict[str, Any]:
        choice = {"text": text, "index": index, "logprobs": scored, "finish_reason": finish}
        return {**head, "choices": [choice]}

    async def pump(index: int, generation: Any, scorer: logprobs.Scorer | None) -> None:
        echoed, scored, offset = opening
        if echoed:
            stream.event(chunk(index, echoed, None, scored))

        async def shaped() -> Any:
            nonlocal offset
            if scorer is None:
                return None
            scores = await scorer.take(generation.tokens)
            scored = logprobs.completion_logprobs(model, scores, None, offset)
            offset = _end(scored, offset)
            return scored

        async for piece in generation:
            stream.event(chunk(index, piece, None, await shaped()))
        finish = "length" if generation.stop_reason == "length" else "stop"
        stream.event(chunk(index, "", finish, await shaped()))

    by_choice = scorers or [None] * len(generations)
    await asyncio.gather(
        *(pump(i, g, s) for i, (g, s) in enumerate(zip(generations, by_choice, strict=True)))
    )
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
