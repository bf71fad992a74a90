"""A chat prompt as it goes into a context: runs of tokens and the media the model's template
placed between them, counted (each medium by its own token count) before any pass runs."""

from __future__ import annotations

from typing import Any

from api_errors import ApiError
from content import MAX_MEDIA_PARTS, Budget, MediaPart, load
from inferlet import Audio, Context, HostError, Image, Video
from inferlet.chat import split_rendered
from inferlet.media import Media
from inferlet.serving import HttpError
from params import MAX_PROMPT_TOKENS

KINDS: dict[str, Any] = {"image": Image, "video": Video, "audio": Audio}


class Prompt:
    def __init__(self, pieces: list[list[int] | Media]) -> None:
        self.pieces = pieces
        self.count = sum(len(p) if isinstance(p, list) else p.token_count() for p in pieces)

    @classmethod
    async def of(cls, model: Any, messages: list[dict[str, Any]], field: str) -> Prompt:
        """The messages rendered with the cue; their media loaded and prepared for `model`.
        Refused with a 400 naming the part: a medium the model cannot take, bytes that are
        not one, more media than a request may hold, a prompt over the endpoint's length."""
        parts = [p for m in messages for p in m.get("media", ())]
        if not parts:
            prompt = cls([model.encode(model.format_chat(messages, True))])
        else:
            _check_parts(model, parts, field)
            media: list[Media] = []
            try:
                budget = Budget()
                for part in parts:
                    media.append(_prepared(model, part, await load(part, budget)))
                pieces = _placed(model, messages, field, media)
            except BaseException:
                for item in media:
                    item.free()
                raise
            prompt = cls([model.encode(p) if isinstance(p, str) else p for p in pieces])
        if prompt.count > MAX_PROMPT_TOKENS:
            raise ApiError(
                400,
                f"{field}: the prompt is {prompt.count} tokens, over the {MAX_PROMPT_TOKENS} this"
                " endpoint takes",
                code="context_length_exceeded",
            )
        return prompt

    async def write(self, ctx: Context) -> None:
        """Queues the tokens and writes each medium where it stands (freeing it then: the
        context holds what it became); the text after the last one stays queued."""
        for piece in self.pieces:
            if isinstance(piece, list):
                ctx.fill_tokens(piece)
                continue
            await getattr(ctx, f"append_{piece.kind}")(piece)
            piece.free()


def _check_parts(model: Any, parts: list[MediaPart], field: str) -> None:
    if len(parts) > MAX_MEDIA_PARTS:
        raise HttpError(
            400, f"{field}: {len(parts)} media parts, over the {MAX_MEDIA_PARTS} a request may hold"
        )
    for part in parts:
        if part.kind not in model.inputs:
            raise HttpError(
                400,
                f"{part.where}: model {model.name!r} does not take {part.kind} input (it reads "
                f"{', '.join(model.inputs)})",
            )


def _prepared(model: Any, part: MediaPart, data: bytes) -> Media:
    try:
        return KINDS[part.kind].from_bytes(model, data)
    except HostError as error:
        raise HttpError(400, f"{part.where}: {error.message}") from None


def _placed(
    model: Any, messages: list[dict[str, Any]], field: str, media: list[Media]
) -> list[str | Media]:
    """The render cut where the template placed each medium."""
    try:
        return split_rendered(model.format_chat(messages, True), media)
    except HostError as error:
        raise HttpError(400, f"{field}: {error.message}") from None
    except ValueError as error:
        raise HttpError(400, f"{field}: {error}") from None
