"""Message content: text parts, and media parts (`image_url`, `video_url`, `input_audio`, and the
Responses API's `input_image`), each marked in the text where it stands; and each medium's bytes,
decoded from a data URL or fetched as the engine's network policy allows, within the request's
bounds."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from inferlet import HostError, http
from inferlet.serving import HttpError

MAX_MEDIA_PARTS = 8
"""Images, videos and audio clips one request may hold, all its messages together."""
MAX_MEDIA_BYTES = 32 << 20
"""Their encoded bytes, all together (data URLs decoded, remote ones as fetched)."""
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm")
DETAILS = (None, "auto", "low", "high")
"""`detail` is accepted and has no effect: the model's own processor sizes every picture."""
MARK = "\ue000{}\ue001"
"""How a chat message's text marks a medium for the model's template (the SDK's chat marker);
text may not hold these two characters."""


@dataclass(frozen=True)
class MediaPart:
    """A medium in a message: where the request holds it, its kind and its URL (a data URL or
    an http(s) one; `input_audio`'s base64 data becomes a data URL)."""

    where: str
    kind: str
    url: str


def content_of(content: Any, where: str) -> tuple[str, list[MediaPart]]:
    """Plain text, or a list of parts: the text parts joined, each medium marked where it
    stands, and the media in order."""
    if isinstance(content, str):
        return _text(content, where), []
    if not isinstance(content, list):
        raise HttpError(400, f"{where}: a string or a list of content parts")
    texts, media = [], []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(_text(part["text"], at))
            continue
        medium = media_part(part, at)
        texts.append(MARK.format(medium.kind))
        media.append(medium)
    return "".join(texts), media


def media_part(part: Any, where: str) -> MediaPart:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("image_url", "video_url"):
        given = part.get(kind)
        url = given.get("url") if isinstance(given, dict) else None
        if not isinstance(url, str) or given.get("detail") not in DETAILS:
            raise HttpError(400, f"{where}.{kind}: an object with a `url` (and `detail`)")
        return MediaPart(where, kind.removesuffix("_url"), url)
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or part.get("detail") not in DETAILS:
            raise HttpError(400, f"{where}.image_url: a data URL or an http(s) URL")
        return MediaPart(where, "image", url)
    if kind == "input_audio":
        given = part.get("input_audio")
        data = given.get("data") if isinstance(given, dict) else None
        fmt = given.get("format") if isinstance(given, dict) else None
        if not isinstance(data, str) or fmt not in AUDIO_FORMATS:
            raise HttpError(
                400,
                f"{where}.input_audio: an object with base64 `data` and a `format` of "
                f"{', '.join(AUDIO_FORMATS)}",
            )
        return MediaPart(where, "audio", f"data:audio/{fmt};base64,{data}")
    raise HttpError(
        400, f"{where}: a part is text, image_url, video_url, input_image or input_audio"
    )


def _text(text: str, where: str) -> str:
    if "\ue000" in text or "\ue001" in text:
        raise HttpError(400, f"{where}: text may not hold the characters U+E000 or U+E001")
    return text


class Budget:
    """What is left of the request's media bytes."""

    def __init__(self) -> None:
        self.left = MAX_MEDIA_BYTES

    def take(self, size: int, where: str) -> None:
        if size > self.left:
            raise HttpError(
                400,
                f"{where}: the request's media are over the {MAX_MEDIA_BYTES >> 20} MiB this"
                " endpoint takes in all",
            )
        self.left -= size


async def load(part: MediaPart, budget: Budget) -> bytes:
    """The medium's encoded bytes."""
    if part.url.startswith("data:"):
        return _decoded(part, budget)
    if part.url.startswith(("http://", "https://")):
        data = await _fetched(part)
        budget.take(len(data), part.where)
        return data
    raise HttpError(400, f"{part.where}: the URL must be a data URL or an http(s) URL")


def _decoded(part: MediaPart, budget: Budget) -> bytes:
    header, comma, data = part.url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise HttpError(400, f"{part.where}: a data URL must be base64 (`data:TYPE;base64,...`)")
    budget.take(len(data) * 3 // 4, part.where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise HttpError(400, f"{part.where}: the base64 data is broken ({error})") from None


async def _fetched(part: MediaPart) -> bytes:
    try:
        response = await http.fetch(part.url)
    except HostError as error:
        if error.kind == "denied":
            raise HttpError(
                400,
                f"{part.where}: remote media is not allowed by the engine's network policy "
                f"({error.message}); send it as a data URL",
            ) from None
        raise HttpError(400, f"{part.where}: fetching the URL failed: {error.message}") from None
    if not response.ok:
        raise HttpError(400, f"{part.where}: the URL answered {response.status}")
    return response.body
