"""Audio output: the `audio` of a chat completion (`modalities: ["text", "audio"]`) and
`POST /audio/speech`, spoken by a model that speaks, with the voice, format and length checked
and the engine's refusals turned into the API's errors."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

from api_errors import ApiError
from inferlet import HostError, Model, models, runtime
from inferlet.serving import HttpError, Response
from inferlet.speech import max_seconds, voices
from params import chat_messages, refuse_unsupported, text_of

MAX_SPEECH_SECONDS = 30.0
"""The longest clip a request produces (the engine's [media] speech_max_seconds bounds it too:
keep that at least this long)."""
MAX_INPUT_CHARS = 4096
"""`input` of `POST /audio/speech` at most, as OpenAI's API."""
VOICE_NAMES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
    "verse", "marin", "cedar",
)  # fmt: skip
"""OpenAI's voice names, mapped in this order onto the model's voices in theirs."""
CHAT_FORMATS = {"wav": "wav", "pcm16": "pcm"}
SPEECH_FORMATS = {"wav": "wav", "pcm": "pcm"}
CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
SPEECH_FIELDS = {"model", "input", "voice", "response_format"}
SPEECH_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "speed": (1, 1.0),
    "instructions": ("",),
    "stream_format": ("audio",),
}
"""`POST /audio/speech` fields accepted only with the value that asks for the default."""
READ_OUT_FIELDS = {"model", "messages", "modalities", "audio", "user", "stream", "n"}
"""What a chat completion on a model that speaks takes: it reads the last user message out."""


@dataclass(frozen=True)
class AudioOut:
    """How a chat completion's reply is spoken: by which model, in which voice and format;
    `reads_out` when the request's model speaks (and so reads the user's text out)."""

    speaker: Model
    voice: int
    fmt: str
    reads_out: bool


def requested(model: Model, body: dict[str, Any]) -> AudioOut | None:
    """The audio a chat completion asks for (None: text only), every field checked."""
    asked = _asks_audio(body.get("modalities"))
    if not asked and body.get("audio") is None:
        return None
    speaker = speaker_for(model)
    if speaker is None:
        field = "modalities" if asked else "audio"
        raise HttpError(400, f"{field}: audio output is not supported by model {model.name!r}")
    if not asked:
        raise HttpError(400, 'audio: only with modalities ["text", "audio"]')
    given = body.get("audio")
    if not isinstance(given, dict) or set(given) - {"voice", "format"}:
        raise HttpError(400, "audio: an object with `voice` and `format`")
    if body.get("stream"):
        raise HttpError(400, "stream: audio output is not streamed; ask without `stream`")
    if body.get("n") not in (None, 1):
        raise HttpError(400, "n: audio output comes with one choice")
    fmt = _format(given.get("format"), CHAT_FORMATS, "audio.format")
    voice = voice_of(speaker, given.get("voice"), "audio.voice")
    return AudioOut(speaker, voice, fmt, reads_out=speaker is model)


def _asks_audio(modalities: Any) -> bool:
    """Whether `modalities` asks for audio, which comes with text (as OpenAI's API has it)."""
    if modalities is None:
        return False
    if not isinstance(modalities, list) or not all(m in ("text", "audio") for m in modalities):
        raise HttpError(400, 'modalities: a list of "text" and "audio"')
    if "audio" in modalities and "text" not in modalities:
        raise HttpError(400, 'modalities: audio comes with text, as ["text", "audio"]')
    return "audio" in modalities


def speaker_for(model: Model) -> Model | None:
    """The request's model if it speaks, else the engine's first model that does."""
    if "speech" in model.outputs:
        return model
    for name in models():
        candidate = Model.load(name)
        if "speech" in candidate.outputs:
            return candidate
    return None


def voice_of(speaker: Model, given: Any, field: str) -> int:
    """A speaker id as a string ("0"), one of OpenAI's names, or `{"id": ...}` of either."""
    ids = voices(speaker)
    name = given.get("id") if isinstance(given, dict) and set(given) == {"id"} else given
    if isinstance(name, str) and name.isdigit() and int(name) in ids:
        return int(name)
    if name in VOICE_NAMES[: len(ids)]:
        return ids[VOICE_NAMES.index(name)]
    known = [str(i) for i in ids] + list(VOICE_NAMES[: len(ids)])
    raise HttpError(
        400, f"{field}: {given!r} is not a voice of model {speaker.name!r} ({', '.join(known)})"
    )


def _format(given: Any, formats: dict[str, str], field: str) -> str:
    if given not in formats:
        raise HttpError(
            400, f"{field}: {given!r} is not produced by this server ({', '.join(formats)})"
        )
    return formats[given]


async def spoken(speaker: Model, text: str, voice: int, fmt: str, field: str) -> bytes:
    """`text` said in `voice`, as a WAV file or its raw 16-bit samples (`pcm`). The engine's
    refusals: a bound on clips held is a 429, a text it cannot say a 400 naming `field`."""
    longest = min(MAX_SPEECH_SECONDS, max_seconds(speaker))
    request = speaker.speak(text).speaker(voice).max_duration(longest)
    try:
        with await request.generate() as speech:
            wav = speech.to_wav()
    except HostError as error:
        if error.kind == "quota":
            raise ApiError(
                429, f"too many clips at once: {error.message}", code="rate_limit_exceeded"
            ) from None
        if error.kind == "invalid":
            raise HttpError(400, f"{field}: {error.message.removeprefix('text: ')}") from None
        raise
    return wav if fmt == "wav" else pcm_of(wav)


def pcm_of(wav: bytes) -> bytes:
    """The samples of a WAV file's `data` chunk."""
    at = 12
    while at + 8 <= len(wav):
        size = int.from_bytes(wav[at + 4 : at + 8], "little")
        if wav[at : at + 4] == b"data":
            return wav[at + 8 : at + 8 + size]
        at += 8 + size + (size & 1)
    raise ValueError("the WAV file holds no data chunk")


async def message_audio(out: AudioOut, transcript: str, field: str) -> dict[str, Any]:
    """A reply message's `audio`, as OpenAI returns it. Nothing is kept for a later turn, so it
    expires as it is made."""
    data = await spoken(out.speaker, transcript, out.voice, out.fmt, field)
    return {
        "id": f"audio_{runtime.instance_id()}",
        "data": base64.b64encode(data).decode(),
        "expires_at": int(time.time()),
        "transcript": transcript,
    }


async def read_out(model: Model, body: dict[str, Any], out: AudioOut) -> dict[str, Any]:
    """A chat completion on a model that speaks: the last user message's text, read out."""
    refuse_unsupported(body, READ_OUT_FIELDS)
    messages = body.get("messages")
    users = [i for i, m in enumerate(chat_messages(messages)) if m["role"] == "user"]
    if not users:
        raise HttpError(400, "messages: no user message to read out")
    where = f"messages[{users[-1]}].content"
    transcript = text_of(messages[users[-1]].get("content"), where)
    audio = await message_audio(out, transcript, where)
    prompt = len(model.encode(transcript))
    message = {"role": "assistant", "content": None, "audio": audio}
    return {
        "id": f"chatcmpl-{runtime.instance_id()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model.name,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt},
    }


async def with_audio(out: AudioOut, completion: dict[str, Any]) -> dict[str, Any]:
    """A chat completion whose reply text is spoken: the text moves to `audio.transcript`, as
    OpenAI returns it (a reply of tool calls, or of no text, stays as it is)."""
    message = completion["choices"][0]["message"]
    if message.get("tool_calls") or not message["content"]:
        return completion
    message["audio"] = await message_audio(out, message["content"], "audio")
    message["content"] = None
    return completion


async def create_speech(model: Model, body: dict[str, Any]) -> Response:
    """`POST /audio/speech`: `input` said by `model` (one that speaks), the clip as the body."""
    refuse_unsupported(body, SPEECH_FIELDS, SPEECH_DEFAULTS)
    if "speech" not in model.outputs:
        raise HttpError(400, f"model: audio output is not supported by model {model.name!r}")
    text = body.get("input")
    if not isinstance(text, str) or not 0 < len(text) <= MAX_INPUT_CHARS:
        raise HttpError(400, f"input: a non-empty string of at most {MAX_INPUT_CHARS} characters")
    fmt = _format(body.get("response_format", "wav"), SPEECH_FORMATS, "response_format")
    voice = voice_of(model, body.get("voice"), "voice")
    data = await spoken(model, text, voice, fmt, "input")
    return Response(data, 200, [("content-type", CONTENT_TYPES[fmt])])
