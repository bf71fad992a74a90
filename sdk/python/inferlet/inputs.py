"""A program's JSON input read the way the examples read it: the sampler its `temperature`,
`top_p` and `seed` ask for, the model it names (or the first that reads a kind of media), and a
medium sent as base64 or as a URL fetched under the engine's network policy."""

from __future__ import annotations

import base64
from typing import Any

from inferlet import http
from inferlet.media import Audio, Image, Media, Video
from inferlet.model import Model, models
from inferlet.sampling import Sampler

KINDS = ("image", "video", "audio")


def sampler_from(request: dict[str, Any]) -> Sampler:
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


def model_reading(kind: str, name: str = "") -> Model:
    """The model `name`, else the engine's first model whose inputs include `kind`."""
    if name:
        return Model.load(name)
    names = models()
    for each in names:
        model = Model.load(each)
        if kind in model.inputs:
            return model
    raise ValueError(f"none of the engine's models {names} reads {kind}")


async def media_from(request: dict[str, Any], kind: str, model: Model) -> Media:
    """The medium of `kind` for `model`: base64 bytes under the key `kind`, or fetched from
    `url`; a video takes at most `max_frames` frames (0: the engine's default)."""
    if kind not in KINDS:
        raise ValueError(f"a medium is one of {KINDS}, not {kind!r}")
    if request.get(kind):
        data = base64.b64decode(request[kind], validate=True)
    else:
        data = await _fetch(request.get("url"), kind)
    if kind == "video":
        return Video.from_bytes(model, data, int(request.get("max_frames", 0)))
    return (Image if kind == "image" else Audio).from_bytes(model, data)


async def _fetch(url: Any, kind: str) -> bytes:
    if not url:
        raise ValueError(f'give the {kind} as base64 in "{kind}" or as an http(s) "url"')
    if not str(url).startswith(("http://", "https://")):
        raise ValueError(f"the url must be http or https, not {url!r}")
    body: bytes = (await http.get(str(url))).raise_for_status().body
    return body
