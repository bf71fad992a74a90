"""Speech as programs use it, for engine tests: greedy tokens of a text model beside speech, the
refusals a program gets (going on afterwards), and clips held against the per-inferlet and
per-user bounds, another program of the same user told through a queue."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from inferlet import Context, HostError, Model, Sampler, messaging


async def text(input: dict[str, Any]) -> Any:
    """Greedy tokens after a prompt on a text model."""
    with Context(Model.load(input["model"])) as ctx:
        ctx.fill_tokens(input["prompt"])
        generation = ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop_tokens=[])
        return await generation.collect_tokens()


async def _attempt(case: dict[str, Any]) -> Any:
    request = Model.load(case["model"]).speak(case["text"])
    try:
        speech = await request.speaker(case["speaker"]).max_duration(case["seconds"]).generate()
    except HostError as err:
        return {"kind": err.kind, "message": err.message}
    with speech:
        return {"seconds": speech.duration()}


async def _wav(model: Model, case: dict[str, Any]) -> Any:
    request = model.speak(case["text"]).speaker(case["speaker"]).max_duration(case["seconds"])
    with await request.generate() as speech:
        return {"seconds": speech.duration(), "wav": base64.b64encode(speech.to_wav()).decode()}


async def together(input: dict[str, Any]) -> Any:
    """Every case spoken at once: each clip's WAV (base64) and seconds."""
    model = Model.load(input["model"])
    return list(await asyncio.gather(*(_wav(model, case) for case in input["cases"])))


async def refusals(input: dict[str, Any]) -> Any:
    """Each case refused with its kind and message, or the seconds it spoke."""
    return [await _attempt(case) for case in input["cases"]]


async def hold(input: dict[str, Any]) -> Any:
    """After a message on `before` (if given), speaks `count` clips one after another, holding
    them: None for each spoken, the error of each refused. Then tells `signal`, waits for
    `wait`, frees them all and speaks `case`."""
    model = Model.load(input["model"])
    if input.get("before"):
        await messaging.pull(input["before"])
    held, seen = [], []
    for _ in range(input["count"]):
        try:
            held.append(await model.speak(input["text"]).max_duration(input["seconds"]).generate())
            seen.append(None)
        except HostError as err:
            seen.append({"kind": err.kind, "message": err.message})
    if input.get("signal"):
        messaging.push(input["signal"], "held")
    if input.get("wait"):
        await messaging.pull(input["wait"])
    for speech in held:
        speech.free()
    after = await _attempt({**input["case"]})
    return {"seen": seen, "after": after}


MODES = {"text": text, "together": together, "refusals": refusals, "hold": hold}
