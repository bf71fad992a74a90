"""Files a client sends to a session, for tests: each message of bytes becomes a picture whose
token count and grid are sent back (or the refusal's kind), until "bye"; and a chat turn about
one picture answered greedily, the reference for the OpenAI endpoint's media tests."""

from __future__ import annotations

import base64
import json
from typing import Any

from inferlet import Context, HostError, Image, Model, Sampler, session


async def files(model: Model) -> int:
    """Answers each picture; returns how many it answered."""
    count = 0
    while (message := await session.receive()) != "bye":
        if not isinstance(message, bytes):
            session.send(json.dumps({"error": "text", "message": message}))
            continue
        try:
            with Image.from_bytes(model, message) as image:
                answer = {"tokens": image.token_count(), "grid": list(image.grid())}
        except HostError as err:
            answer = {"error": err.kind, "message": err.message}
        count += 1
        session.send(json.dumps(answer))
    return count


async def chat(model: Model, input: dict[str, Any]) -> Any:
    """A user turn of the picture then the text, cued, and greedy tokens after it."""
    image = Image.from_bytes(model, base64.b64decode(input["image"]))
    with Context(model) as ctx:
        ctx.user([image, input["text"]]).cue()
        await ctx.flush()
        prompt = len(ctx.tokens)
        generation = ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop_tokens=[])
        text = await generation.collect_text()
    return {"prompt": prompt, "tokens": generation.tokens, "text": text}


MODES = {
    "files": lambda input: files(Model.load(input.get("model", ""))),
    "chat": lambda input: chat(Model.load(input["model"]), input),
}
