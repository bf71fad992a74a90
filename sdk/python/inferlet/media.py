"""Images, video and audio as a program hands them to the engine: encoded bytes, decoded and
prepared for one model at once, so their token count and grid are known before any pass.
`ctx.append_image(image)` (and `append_video`, `append_audio`) puts one into a context."""

from __future__ import annotations

from typing import Any

from wit_world.imports import forward as _fw
from wit_world.imports import media as _media

from inferlet import _loop
from inferlet.errors import call
from inferlet.model import Model


class Media:
    """A prepared media item, held by the engine until `free()` (or the program's end)."""

    kind = ""

    def __init__(self, model: Model, handle: int) -> None:
        self.model = model
        self.handle = handle
        info = call(_media.info, handle)
        self._tokens: int = info.tokens
        self._soft: int = info.soft_tokens
        self._grid: tuple[int, int, int] = tuple(info.grid)
        self.hash: str = info.hash
        """The content hash: equal bytes (and options) give equal hashes."""

    def token_count(self) -> int:
        """Tokens the item takes in a context, its delimiters included."""
        return self._tokens

    def soft_token_count(self) -> int:
        """The encoder's outputs among them."""
        return self._soft

    def grid(self) -> tuple[int, int, int]:
        """(time, height, width) of its soft tokens."""
        return self._grid

    def free(self) -> None:
        call(_media.free, self.handle)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tokens={self._tokens}, grid={self._grid})"


class Image(Media):
    kind = "image"

    @classmethod
    def from_bytes(cls, model: Model, data: bytes) -> Image:
        """A PNG, JPEG, GIF (first frame) or WebP picture, for `model`."""
        return cls(model, call(_media.image_from_bytes, model.handle, bytes(data)))


class Video(Media):
    kind = "video"

    @classmethod
    def from_bytes(cls, model: Model, data: bytes, max_frames: int = 0) -> Video:
        """A video (or animated GIF/WebP), at most `max_frames` frames sampled uniformly (0:
        the engine's [media] video_frames)."""
        return cls(model, call(_media.video_from_bytes, model.handle, bytes(data), max_frames))


class Audio(Media):
    kind = "audio"

    @classmethod
    def from_bytes(cls, model: Model, data: bytes) -> Audio:
        """WAV, FLAC, MP3, Ogg or another common format, resampled for `model`."""
        return cls(model, call(_media.audio_from_bytes, model.handle, bytes(data)))


async def append(context_handle: int, item: Media) -> None:
    """Writes the item's tokens into a context in one pass (awaited on the loop, so other
    branches' passes batch with it)."""
    handle = call(_media.append, context_handle, item.handle)
    await _loop.ready(handle)
    call(_fw.outputs, handle)
