"""`POST /responses`: the Responses API's text subset (`input` as a string or a list of
messages, whose parts may be `input_image` and `input_audio`; `instructions`), `text.format` for
JSON output, returned whole or as its stream of typed server-sent events."""

from __future__ import annotations

import time
from typing import Any

from content import content_of
from inferlet import Context, runtime, serving
from inferlet.serving import HttpError
from params import RESPONSES_FIELDS, Params, chat_messages, refuse_unsupported
from prompt import Prompt


async def create(model: Any, body: dict[str, Any]) -> Any:
    refuse_unsupported(body, RESPONSES_FIELDS)
    params = Params.of(body, length_keys=("max_output_tokens",))
    messages = _input_messages(body)
    ident = runtime.instance_id()
    prompt = await Prompt.of(model, messages, "input")
    with Context(model) as ctx:
        await prompt.write(ctx)
        generation = params.generate(ctx, params.sampler)
        shell = _Shell(ident, model.name, body, prompt.count)
        if not body.get("stream"):
            text = await generation.collect_text()
            return shell.response("completed", [shell.message(text, "completed")], generation)
        await _stream(shell, generation)
        return None


def _input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    given = body.get("input")
    if isinstance(given, str):
        messages = [{"role": "user", "content": content_of(given, "input")[0]}]
    else:
        items = [_item(i) for i in given] if isinstance(given, list) else given
        messages = chat_messages(items, "input")
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise HttpError(400, "instructions: a string")
        system, _ = content_of(instructions, "instructions")
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _item(item: Any) -> Any:
    """An input item of type `message` (or with no type) as a chat message."""
    if isinstance(item, dict) and item.get("type", "message") != "message":
        raise HttpError(400, f"input: items of type {item.get('type')!r} are not supported")
    return item


class _Shell:
    """The parts of a response object that do not depend on the generated text."""

    def __init__(self, ident: str, model: str, body: dict[str, Any], prompt: int) -> None:
        self.id = f"resp_{ident}"
        self.message_id = f"msg_{ident}"
        self.model = model
        self.created = int(time.time())
        self.body = body
        self.prompt = prompt

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if text else []
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(self, status: str, output: list[Any], generation: Any = None) -> dict[str, Any]:
        incomplete = generation is not None and generation.stop_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "model": self.model,
            "instructions": self.body.get("instructions"),
            "max_output_tokens": self.body.get("max_output_tokens"),
            "temperature": self.body.get("temperature", 1.0),
            "top_p": self.body.get("top_p", 1.0),
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "output": output,
            "usage": _usage(self.prompt, generation),
        }


def _usage(prompt: int, generation: Any) -> dict[str, Any] | None:
    """The prompt's tokens counted with its media (a generation sees only the text after the
    last medium)."""
    if generation is None:
        return None
    completion = len(generation.tokens)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


async def _stream(shell: _Shell, generation: Any) -> None:
    stream = serving.respond(
        200, {"content-type": "text/event-stream", "cache-control": "no-cache"}
    )
    sequence = iter(range(1 << 30))

    def emit(kind: str, **fields: Any) -> None:
        stream.event({"type": kind, "sequence_number": next(sequence), **fields}, event=kind)

    where = {"item_id": shell.message_id, "output_index": 0, "content_index": 0}
    emit("response.created", response=shell.response("in_progress", []))
    emit("response.in_progress", response=shell.response("in_progress", []))
    emit("response.output_item.added", output_index=0, item=shell.message("", "in_progress"))
    empty_part = {"type": "output_text", "text": "", "annotations": []}
    emit("response.content_part.added", part=empty_part, **where)
    async for piece in generation:
        emit("response.output_text.delta", delta=piece, logprobs=[], **where)
    text = generation.text
    emit("response.output_text.done", text=text, logprobs=[], **where)
    part = {"type": "output_text", "text": text, "annotations": []}
    emit("response.content_part.done", part=part, **where)
    item = shell.message(text, "completed")
    emit("response.output_item.done", output_index=0, item=item)
    final = shell.response("completed", [item], generation)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    emit(kind, response=final)
