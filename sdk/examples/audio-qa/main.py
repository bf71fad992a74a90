"""Answers a question about one recording: the clip and the question as a user message (after
an optional system message) in the model's chat template, then generation. The clip comes as
base64 bytes or from a URL; any model with an audio tower runs it unchanged."""

from __future__ import annotations

import base64
from typing import Any

from inferlet import Audio, Context, Model, Sampler, http, models

KIND = "audio"


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = model_for(input, KIND)
    data = await media_bytes(input, KIND)
    with Audio.from_bytes(model, data) as clip, Context(model) as ctx:
        if input.get("system"):
            ctx.system(input["system"])
        before = [input["before"]] if input.get("before") else []
        ctx.user([*before, clip, input.get("question", "What is in this recording?")]).cue()
        generation = ctx.generate(
            choose_sampler(input), max_tokens=int(input.get("max_tokens", 128))
        )
        text = await generation.collect_text()
        return {
            "text": text,
            "tokens": generation.tokens,
            "media_tokens": clip.token_count(),
            "grid": list(clip.grid()),
        }


def model_for(request: dict[str, Any], kind: str) -> Model:
    """The model the request names, else the engine's first model that reads `kind`."""
    if request.get("model"):
        return Model.load(request["model"])
    names = models()
    for name in names:
        model = Model.load(name)
        if kind in model.inputs:
            return model
    raise ValueError(f"none of the engine's models {names} reads {kind}")


async def media_bytes(request: dict[str, Any], kind: str) -> bytes:
    """The medium's bytes: base64 under `kind`, or fetched from `url` (under the engine's
    network policy)."""
    if request.get(kind):
        return base64.b64decode(request[kind], validate=True)
    url = request.get("url")
    if not url:
        raise ValueError(f'give the {kind} as base64 in "{kind}" or as an http(s) "url"')
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the url must be http or https, not {url!r}")
    return (await http.get(url)).raise_for_status().body


def choose_sampler(request: dict[str, Any]) -> Sampler:
    """Temperature 0 (the default) is greedy; otherwise nucleus when top_p < 1 is given, else
    multinomial; `seed` makes either reproducible."""
    temperature = float(request.get("temperature", 0.0))
    seed = request.get("seed")
    if temperature == 0:
        return Sampler.argmax()
    top_p = request.get("top_p")
    if top_p is not None and float(top_p) < 1.0:
        return Sampler.top_p(float(top_p), temperature=temperature, seed=seed)
    return Sampler.multinomial(temperature=temperature, seed=seed)
