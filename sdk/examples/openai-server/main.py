"""An OpenAI-compatible API as an HTTP-served inferlet: `GET /models`, `POST /chat/completions`,
`POST /completions` and `POST /responses`, whole or streamed as server-sent events.
`pie serve --http PORT --openai` mounts it at /v1; each request runs in its own instance,
batched with everything else."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import completions
import logprobs
import responses
from inferlet import Context, HostError, get_model, runtime, serving
from inferlet.serving import HttpError, Request, Response
from params import (
    CHAT_FIELDS,
    ApiError,
    Params,
    chat_messages,
    error_body,
    prompt_tokens,
    refuse_unsupported,
)


async def handle(request: Request) -> Any:
    """Client errors come back as the API's error object; anything else fails the instance, and
    the server answers 500 without the traceback (it logs it)."""
    try:
        return await _route(request)
    except HttpError as error:
        if serving.streamed():
            raise
        return Response.json(error_body(error), error.status)
    except HostError as error:
        refused = _refusal(error)
        if refused is None or serving.streamed():
            raise
        return Response.json(error_body(refused), refused.status)


def _refusal(error: HostError) -> ApiError | None:
    """What the engine's refusal means to an API client: a prompt that can never fit is the
    client's error (400); a full KV cache is the server's, for now (503)."""
    if error.kind == "too-large":
        return ApiError(400, f"messages: {error.message}", code="context_length_exceeded")
    if error.kind == "out-of-pages":
        return ApiError(503, f"the server is out of KV cache: {error.message}", code="overloaded")
    return None


async def _route(request: Request) -> Any:
    route = (request.method, request.path.rstrip("/"))
    model = get_model()
    if route == ("GET", "/models"):
        return {"object": "list", "data": [_model_card(model.name)]}
    if request.method == "GET" and request.path.startswith("/models/"):
        _check_model(request.path.removeprefix("/models/"), model.name)
        return _model_card(model.name)
    if route == ("POST", "/chat/completions"):
        body = _body(request)
        _check_model(body.get("model"), model.name)
        return await chat_completion(model, body)
    if route == ("POST", "/completions"):
        body = _body(request)
        _check_model(body.get("model"), model.name)
        return await completions.create(model, body)
    if route == ("POST", "/responses"):
        body = _body(request)
        _check_model(body.get("model"), model.name)
        return await responses.create(model, body)
    raise HttpError(404, f"no route {request.method} {request.path}")


async def chat_completion(model: Any, body: dict[str, Any]) -> Any:
    refuse_unsupported(body, CHAT_FIELDS)
    params = Params.of(
        body, length_keys=("max_completion_tokens", "max_tokens"), vocab_size=model.vocab_size
    )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HttpError(400, "stream_options: an object")
    top = logprobs.chat_top(body)
    params.stream_checks(body)
    prompt = prompt_tokens(model, chat_messages(body.get("messages")), "messages")
    with Context(model) as ctx:
        ctx.fill_tokens(prompt)
        generations = await params.choices(ctx, body)
        reply = _Reply(f"chatcmpl-{runtime.instance_id()}", model.name, len(prompt), generations)
        if not body.get("stream"):
            texts = await asyncio.gather(*(g.collect_text() for g in generations))
            scored = None
            if top is not None:
                outputs = [g.tokens for g in generations]
                scores = await logprobs.score(model, prompt, outputs, top)
                tail = len(prompt) - 1
                scored = [logprobs.chat_content(model, s[tail:]) for s in scores]
            return reply.completion(texts, scored)
        await reply.stream(bool(options.get("include_usage")))
        return None


class _Reply:
    """A chat completion's choices, whole or as chunks; choices stream side by side."""

    def __init__(self, ident: str, name: str, prompt: int, generations: list[Any]) -> None:
        self.ident = ident
        self.name = name
        self.prompt = prompt
        self.generations = generations
        self.created = int(time.time())

    def completion(self, texts: list[str], scored: list[Any] | None = None) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None if scored is None else scored[i],
                "finish_reason": _finish_reason(generation),
            }
            for i, (text, generation) in enumerate(zip(texts, self.generations, strict=True))
        ]
        return {**self._head("chat.completion"), "choices": choices, "usage": self.usage()}

    async def stream(self, include_usage: bool) -> None:
        stream = serving.respond(
            200, {"content-type": "text/event-stream", "cache-control": "no-cache"}
        )

        def chunk(index: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}

        async def pump(index: int, generation: Any) -> None:
            async for piece in generation:
                stream.event(chunk(index, {"content": piece}, None))
            stream.event(chunk(index, {}, _finish_reason(generation)))

        for index in range(len(self.generations)):
            stream.event(chunk(index, {"role": "assistant", "content": ""}, None))
        await asyncio.gather(*(pump(i, g) for i, g in enumerate(self.generations)))
        if include_usage:
            stream.event(
                {**self._head("chat.completion.chunk"), "choices": [], "usage": self.usage()}
            )
        stream.write("data: [DONE]\n\n")

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.name}

    def usage(self) -> dict[str, int]:
        completion = sum(len(g.tokens) for g in self.generations)
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": completion,
            "total_tokens": self.prompt + completion,
        }


def _finish_reason(generation: Any) -> str:
    return "length" if generation.stop_reason == "length" else "stop"


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pie"}


def _check_model(requested: Any, served: str) -> None:
    if requested != served:
        raise ModelNotFound(requested)


class ModelNotFound(ApiError):
    def __init__(self, requested: Any) -> None:
        super().__init__(404, f"The model `{requested}` does not exist", "model_not_found")


def _body(request: Request) -> dict[str, Any]:
    body = request.json()
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    return body
