"""Audio out through the OpenAI endpoint, with the real `openai` client, on a tiny random CSM
served beside a tiny text model: `/v1/audio/speech` and a chat completion on the CSM (which reads
the user's text out) give transformers' greedy speech; a chat completion on the text model speaks
its own greedy reply through the CSM; bad voices, formats and fields are 400s naming the field,
a bound on clips held a 429, and the server serves afterwards."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import openai
import pytest
import trio
from transformers import PreTrainedTokenizerFast

from pie.config import HttpConfig, config_from_dict
from pie.engine import open_engine
from pie.server.http import HttpFront
from pie.server.mounts import OPENAI_PREFIX, OPENAI_SERVER, Mounts
from tests.inferlet_fixtures import GUESTS, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.test_models_csm import CSM, save_tiny_csm
from tests.test_speech_engine import WAV_TOLERANCE, assert_wav_matches, hf_audio, quieted
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.model

FOX = "The quick brown fox."
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
HTTP_USER = HttpConfig().user
"""The user the endpoint's requests run for (no authentication on loopback)."""


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory,
    built: Callable[[Path], Path],  # noqa: F811
) -> SimpleNamespace:
    """The models' config, the server and probe components, and transformers' CSM speech
    (`speech(text, speaker)`, its codec scaled so clips stay inside [-1, 1]; `fox`, FOX said by
    speaker 1)."""
    root = tmp_path_factory.mktemp("openai-audio")
    reference = save_tiny_csm(root / "csm")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(root / "csm")

    def speech(text: str, speaker: int) -> np.ndarray:
        """The clip the server asks for: as long as the model's positions allow."""
        prompt = f"<|begin_of_text|>[{speaker}]{text}<|end_of_text|>"
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        return hf_audio(reference, ids, CSM["max_position_embeddings"] - len(ids))

    fox = quieted(reference, {FOX: speech(FOX, 1)})[FOX]
    reference.save_pretrained(root / "csm")
    save_tiny_model(root / "text", dict(model_type="llama"))
    (root / "text" / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    common = {"dtype": "float32", "device": "cpu"}
    config = config_from_dict(
        {
            "models": [
                {"name": "csm", "path": str(root / "csm"), **common},
                {"name": "text", "path": str(root / "text"), **common},
            ],
            "kv": {"num_pages": 256, "page_size": 4},
            # Below the endpoint's own 30 s: it asks the engine for no more than this.
            "media": {"max_speech_per_user": 1, "speech_max_seconds": 20},
        }
    )
    return SimpleNamespace(
        config=config,
        server=built(OPENAI_SERVER).read_bytes(),
        probe=built(GUESTS / "media_probe").read_bytes(),
        speech=speech,
        fox=fox,
    )


@contextlib.asynccontextmanager
async def endpoint(tiny: SimpleNamespace) -> AsyncIterator[SimpleNamespace]:
    """One engine behind the OpenAI API (`api`, an openai client)."""
    async with open_engine(tiny.config) as engine:
        mounts = Mounts({OPENAI_PREFIX: engine.programs.add(tiny.server, name="openai").hash})
        front = HttpFront(engine, HttpConfig(port=0), mounts, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run)
            api = openai.OpenAI(
                base_url=f"{front.url}{OPENAI_PREFIX}", api_key="-", max_retries=0, timeout=120
            )
            yield SimpleNamespace(engine=engine, api=api)
            front.stop()
            nursery.cancel_scope.cancel()


async def call(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def refused(fn: Callable[[], Any]) -> Any:
    """The error object of a call refused with a 400 (what it returned otherwise)."""
    try:
        return await call(fn)
    except openai.BadRequestError as error:
        return error.body


def user_says(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def speak(api: openai.OpenAI, **overrides: Any) -> Callable[[], Any]:
    request = {"model": "csm", "input": FOX, "voice": "1", "response_format": "wav"}
    return lambda: api.audio.speech.create(**{**request, **overrides})


def chat(api: openai.OpenAI, **overrides: Any) -> Callable[[], Any]:
    request = {
        "model": "csm",
        "messages": user_says(FOX),
        "modalities": ["text", "audio"],
        "audio": {"voice": "1", "format": "wav"},
    }
    return lambda: api.chat.completions.create(**{**request, **overrides})


async def test_speech_and_spoken_chat_replies_equal_transformers(tiny: SimpleNamespace) -> None:
    greedy = {"model": "text", "messages": user_says("Hi"), "max_tokens": 4, "temperature": 0}
    async with endpoint(tiny) as served:
        api = served.api
        with trio.fail_after(120):
            wav = (await call(speak(api, voice="ash"))).content
            pcm = (await call(speak(api, response_format="pcm"))).content
            read_out = await call(chat(api, messages=[*user_says("Hello"), *user_says(FOX)]))
            text_only = await call(lambda: api.chat.completions.create(**greedy))
            spoken = await call(chat(api, **greedy, audio={"voice": "alloy", "format": "pcm16"}))
    assert_wav_matches(wav, tiny.fox)
    assert wav.endswith(pcm) and len(pcm) == 2 * tiny.fox.size
    message = read_out.choices[0].message
    assert message.content is None and message.audio.transcript == FOX
    assert base64.b64decode(message.audio.data) == wav
    reply = text_only.choices[0].message.content
    assert reply and spoken.choices[0].message.audio.transcript == reply
    samples = np.frombuffer(base64.b64decode(spoken.choices[0].message.audio.data), "<i2")
    expected = tiny.speech(reply, 0)
    assert np.abs(expected).max() < 1 and samples.size == expected.size
    assert np.abs(samples / 32768 - expected).max() <= WAV_TOLERANCE


async def test_refusals_name_the_field_and_the_server_goes_on(
    tiny: SimpleNamespace,
) -> None:
    cases: dict[str, Callable[[openai.OpenAI], Callable[[], Any]]] = {
        "audio.voice": lambda api: chat(api, audio={"voice": "7", "format": "wav"}),
        "audio.format": lambda api: chat(api, audio={"voice": "0", "format": "mp3"}),
        "stream": lambda api: chat(api, stream=True),
        "modalities": lambda api: chat(api, modalities=["audio"]),
        "audio": lambda api: chat(api, modalities=["text"]),
        "n": lambda api: chat(api, model="text", n=2),
        "voice": lambda api: speak(api, voice="nova"),
        "response_format": lambda api: speak(api, response_format="mp3"),
        "speed": lambda api: speak(api, speed=1.5),
        "instructions": lambda api: speak(api, instructions="whisper"),
        "model": lambda api: speak(api, model="text"),
        "input": lambda api: speak(api, input="0123456789" * 8),
    }
    seen = {}
    async with endpoint(tiny) as served:
        with trio.fail_after(120):
            for field, request in cases.items():
                seen[field] = await refused(request(served.api))
            served_after = (await call(speak(served.api))).content
    for field, body in seen.items():
        assert isinstance(body, dict) and body["param"] == field, (field, body)
    assert seen["model"]["message"] == "model: audio output is not supported by model 'text'"
    assert "room to speak" in seen["input"]["message"]
    assert_wav_matches(served_after, tiny.fox)


async def test_a_user_at_the_speech_bound_gets_a_429_then_speaks_once_a_clip_is_freed(
    tiny: SimpleNamespace,
) -> None:
    """A program of the endpoint's user holds one clip, the user's bound; a request is refused
    until the program frees it."""
    short = {"model": "csm", "text": "pie", "speaker": 0, "seconds": 0.002}
    hold = {
        "probe": "speech",
        "mode": "hold",
        "model": "csm",
        "text": "pie",
        "seconds": 0.002,
        "case": short,
    }
    async with endpoint(tiny) as served:
        engine = served.engine
        program = engine.programs.add(tiny.probe).hash

        async def holder() -> None:
            request = {**hold, "count": 1, "signal": "held", "wait": "go"}
            outcome = await engine.run_inferlet(program, json.dumps(request), user=HTTP_USER)
            assert outcome.ok, outcome.error

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(holder)
                await run_json(engine, program, {**hold, "count": 0, "before": "held"})
                with pytest.raises(openai.RateLimitError) as caught:
                    await call(speak(served.api))
                await run_json(engine, program, {**hold, "count": 0, "signal": "go"})
            served_after = (await call(speak(served.api))).content
    assert "media.max_speech_per_user" in caught.value.body["message"]  # type: ignore[index]
    assert_wav_matches(served_after, tiny.fox)
