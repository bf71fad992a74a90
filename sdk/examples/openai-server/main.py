"""An OpenAI-compatible API as an HTTP-served inferlet: `GET /models`, `POST /chat/completions`,
`POST /completions`, `POST /responses` and `POST /audio/speech`, whole or streamed as server-sent
events; chat messages may hold images, audio and video for a model that reads them, and replies
may be spoken.
`pie serve --http PORT --openai` mounts it at /v1; each request runs in its own instance,
batched with everything else. The model's LoRA adapters are models too (as in vLLM): a request
whose `model` names one runs through it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import completions
import logprobs
import responses
import speech_out
import tools
from api_errors import ApiError, error_body
from inferlet import Context, HostError, Model, models, runtime, serving
from inferlet.serving import HttpError, Request, Response
from params import CHAT_FIELDS, Params, refuse_unsupported
from prompt import Prompt


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
    if route == ("GET", "/models"):
        return {"object": "list", "data": [_model_card(m) for m in _every_model()]}
    if request.method == "GET" and request.path.startswith("/models/"):
        return _model_card(_served(request.path.removeprefix("/models/")))
    if route == ("POST", "/chat/completions"):
        body = _body(request)
        return await chat_completion(_served(body.get("model")), body)
    if route == ("POST", "/completions"):
        body = _body(request)
        return await completions.create(_served(body.get("model")), body)
    if route == ("POST", "/responses"):
        body = _body(request)
        return await responses.create(_served(body.get("model")), body)
    if route == ("POST", "/audio/speech"):
        body = _body(request)
        return await speech_out.create_speech(_served(body.get("model")), body)
    raise ApiError(404, f"no route {request.method} {request.path}", "unknown_url")


async def chat_completion(model: Any, body: dict[str, Any]) -> Any:
    audio = speech_out.requested(model, body)
    if audio is not None and audio.reads_out:
        return await speech_out.read_out(model, body, audio)
    refuse_unsupported(body, CHAT_FIELDS)
    params = Params.of(
        body, length_keys=("max_completion_tokens", "max_tokens"), vocab_size=model.vocab_size
    )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HttpError(400, "stream_options: an object")
    top = logprobs.chat_top(body)
    use = tools.tool_use(body)
    messages = tools.with_tools(tools.conversation(body.get("messages")), use)
    if use.offered:
        params.grammar = tools.compile_grammar(model, use, params.schema)
    prompt = await Prompt.of(model, messages, "messages")
    with Context(model) as ctx:
        await prompt.write(ctx)
        if top is not None:
            await ctx.flush()  # the scorers fork the prefilled prompt
        generations = await params.choices(ctx, body)
        reply = _Reply(runtime.instance_id(), model, prompt.count, generations, use)
        scorers = [] if top is None else [logprobs.Scorer(ctx, top) for _ in generations]
        try:
            if body.get("stream"):
                await reply.stream(bool(options.get("include_usage")), scorers)
                return None
            texts = await asyncio.gather(*(g.collect_text() for g in generations))
            scored = await logprobs.finished(scorers, generations) if scorers else None
            completion = reply.completion(texts, scored)
        finally:
            for scorer in scorers:
                scorer.close()
    return completion if audio is None else await speech_out.with_audio(audio, completion)


class _Reply:
    """A chat completion's choices, whole or as chunks; choices stream side by side."""

    def __init__(
        self, instance: str, model: Any, prompt: int, generations: list[Any], use: tools.ToolUse
    ) -> None:
        self.instance = instance
        self.model = model
        self.prompt = prompt
        self.generations = generations
        self.use = use
        self.created = int(time.time())

    def completion(self, texts: list[str], scored: list[Any] | None) -> dict[str, Any]:
        choices = [
            self._choice(i, text, None if scored is None else scored[i])
            for i, text in enumerate(texts)
        ]
        return {**self._head("chat.completion"), "choices": choices, "usage": self.usage()}

    def _choice(self, index: int, text: str, scores: list[Any] | None) -> dict[str, Any]:
        content, calls = (text, [])
        if self.use.offered:
            content, calls = tools.split(text, self._call_id(index))
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": index,
            "message": message,
            "logprobs": None if scores is None else logprobs.chat_content(self.model, scores),
            "finish_reason": _finish_reason(self.generations[index], calls),
        }

    async def stream(self, include_usage: bool, scorers: list[logprobs.Scorer]) -> None:
        """Chunks per choice: content as it comes (held back while it may still start a tool
        call), the calls whole at the end; with logprobs, each chunk scores its own tokens."""
        stream = serving.respond(
            200, {"content-type": "text/event-stream", "cache-control": "no-cache"}
        )

        def chunk(
            index: int, delta: dict[str, Any], finish: str | None, scores: list[Any]
        ) -> dict[str, Any]:
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs.chat_chunk(self.model, scores),
                "finish_reason": finish,
            }
            return {**self._head("chat.completion.chunk"), "choices": [choice]}

        async def pump(index: int, generation: Any, scorer: logprobs.Scorer | None) -> None:
            shaper = tools.CallStream(self.use)
            waiting: list[Any] = []  # scores of tokens no chunk has carried yet

            def send(delta: dict[str, Any], finish: str | None = None) -> None:
                stream.event(chunk(index, delta, finish, waiting))
                waiting.clear()

            async for piece in generation:
                if scorer is not None:
                    waiting += await scorer.take(generation.tokens)
                text = shaper.piece(piece)
                if text:
                    send({"content": text})
            if scorer is not None:
                waiting += await scorer.take(generation.tokens)
            rest, calls = shaper.finish(generation.text, self._call_id(index))
            if calls:
                send({"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]})
            elif rest:
                send({"content": rest})
            send({}, _finish_reason(generation, calls))

        for index in range(len(self.generations)):
            stream.event(chunk(index, {"role": "assistant", "content": ""}, None, []))
        by_choice = scorers or [None] * len(self.generations)
        await asyncio.gather(
            *(
                pump(i, g, s)
                for i, (g, s) in enumerate(zip(self.generations, by_choice, strict=True))
            )
        )
        if include_usage:
            stream.event(
                {**self._head("chat.completion.chunk"), "choices": [], "usage": self.usage()}
            )
        stream.write("data: [DONE]\n\n")

    def _head(self, kind: str) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{self.instance}",
            "object": kind,
            "created": self.created,
            "model": self.model.name,
        }

    def _call_id(self, index: int) -> str:
        """Unique across instances and, by the creation time, across engine restarts."""
        return f"call_{self.created:x}{self.instance}_{index}"

    def usage(self) -> dict[str, int]:
        completion = sum(len(g.tokens) for g in self.generations)
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": completion,
            "total_tokens": self.prompt + completion,
        }


def _finish_reason(generation: Any, calls: list[Any]) -> str:
    if generation.stop_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def _model_card(model: Any) -> dict[str, Any]:
    """An OpenAI model entry, with what the model reads and produces (and, for a LoRA adapter,
    the model under it as `root`)."""
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "pie",
        "root": model.root,
        "modalities": {"input": list(model.inputs), "output": list(model.outputs)},
    }


def _every_model() -> list[Any]:
    """Every model the engine serves, each followed by its LoRA adapters, the default first."""
    served = []
    for name in models():
        base = Model.load(name)
        served += [base, *(base.with_adapter(a) for a in base.adapters)]
    return served


def _served(requested: Any) -> Any:
    """The model a request names: one the engine serves, or one of them through one of its
    LoRA adapters (whose contexts then run through it)."""
    for model in _every_model():
        if model.name == requested:
            return model
    raise ModelNotFound(requested)


class ModelNotFound(ApiError):
    def __init__(self, requested: Any) -> None:
        message = f"The model `{requested}` does not exist"
        super().__init__(404, message, "model_not_found", param="model")


def _body(request: Request) -> dict[str, Any]:
    try:
        body = request.json()
    except HttpError as error:
        raise ApiError(400, error.message, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    return body
