"""Speech out through the whole engine, the way programs reach it: a tiny random CSM served beside
a tiny text model. The tts example's WAV equals transformers' greedy speech decoded by its Mimi
codec; two requests at once and a text model's greedy generation, all in flight together, come
out right; and refusals (a model that does not speak, bad text, speaker or duration, the
per-inferlet and per-user bounds) reach the program, which goes on to speak."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import trio
from transformers import PreTrainedTokenizerFast

from pie.config import config_from_dict
from pie.engine import open_engine
from pie.events import inferlet as inf_ev
from tests.inferlet_fixtures import EXAMPLES, GUESTS, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.test_models_csm import AUDIO_TOLERANCE, read_wav, save_tiny_csm
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.model

RATE, HOP = 24_000, 16
"""The tiny codec's sample rate and samples per code frame (1500 frames a second)."""
WAV_TOLERANCE = AUDIO_TOLERANCE + 1 / 32768
"""A WAV sample is the float sample rounded to 16 bits."""
LAST_CONV = "decoder.decoder_seanet.layers.8.conv"
FOX = {"text": "The quick brown fox.", "speaker": 1, "frames": 7}
PIE = {"text": "pie speaks", "speaker": 0, "frames": 5}
LONG = 30
"""Frames of each of the two requests made at once (the [media] bound below): long enough
that the second arrives while the first still speaks."""
PAIR = [{**PIE, "frames": LONG}, {**FOX, "frames": LONG}]
PROMPT, TOKENS = [5, 17, 40, 3], 6


def seconds(frames: int) -> float:
    return frames * HOP / RATE


def hf_audio(reference: Any, ids: list[int], frames: int) -> np.ndarray:
    """transformers' greedy speech for a prompt, decoded by its Mimi codec."""
    with torch.inference_mode():
        kwargs = dict(max_new_tokens=frames, do_sample=False, depth_decoder_do_sample=False)
        audio = reference.generate(input_ids=torch.tensor([ids]), output_audio=True, **kwargs)
    return np.asarray(audio[0].numpy())


def quieted(reference: Any, audio: dict[Any, np.ndarray]) -> dict[Any, np.ndarray]:
    """Scales the codec's last convolution (and so every clip, which it makes linearly) to keep
    the clips inside [-1, 1], where a WAV keeps every sample (the random codec's samples run
    past 20); the clips as they are then."""
    scale = 0.5 / max(float(np.abs(clip).max()) for clip in audio.values())
    params = dict(reference.codec_model.named_parameters())
    with torch.no_grad():
        params[f"{LAST_CONV}.weight"].mul_(scale)
        params[f"{LAST_CONV}.bias"].mul_(scale)
    return {key: clip * np.float32(scale) for key, clip in audio.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("speech")
    reference = save_tiny_csm(root / "csm")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(root / "csm")

    def ids(case: dict[str, Any]) -> list[int]:
        prompt = f"<|begin_of_text|>[{case['speaker']}]{case['text']}<|end_of_text|>"
        return list(tokenizer.encode(prompt, add_special_tokens=False))

    cases = (FOX, *PAIR)
    audio = {(c["text"], c["frames"]): hf_audio(reference, ids(c), c["frames"]) for c in cases}
    audio = quieted(reference, audio)
    reference.save_pretrained(root / "csm")
    text = save_tiny_model(root / "text", dict(model_type="llama"))
    with torch.inference_mode():
        out = text.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    common = {"dtype": "float32", "device": "cpu"}
    config = config_from_dict(
        {
            "models": [
                {"name": "csm", "path": str(root / "csm"), **common},
                {"name": "text", "path": str(root / "text"), **common},
            ],
            "kv": {"num_pages": 256, "page_size": 4},
            "media": {
                "speech_max_seconds": seconds(LONG),
                "max_speech_per_inferlet": 2,
                "max_speech_per_user": 3,
            },
        }
    )
    return SimpleNamespace(
        config=config, audio=audio, tokens=out[0, len(PROMPT) :].tolist(), ids=ids
    )


def speech_case(case: dict[str, Any]) -> dict[str, Any]:
    return {"text": case["text"], "speaker": case["speaker"], "seconds": seconds(case["frames"])}


def assert_wav_matches(data: bytes, expected: np.ndarray) -> None:
    rate, samples = read_wav(data)
    assert rate == RATE and samples.shape == (1, expected.size)
    assert np.abs(expected).max() < 1  # nothing clipped: every sample is compared
    assert np.abs(samples[0] - expected).max() <= WAV_TOLERANCE


async def test_speech_equals_transformers_while_two_speak_and_a_text_model_generates(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    tts = built(EXAMPLES / "tts").read_bytes()
    probe = built(GUESTS / "media_probe").read_bytes()
    sent: list[bytes] = []
    results: dict[str, Any] = {}

    def on_event(event: Any) -> None:
        if isinstance(event, inf_ev.SessionMessage) and event.data is not None:
            sent.append(event.data)

    async with open_engine(tiny.config) as engine:
        tts_hash = engine.programs.add(tts).hash
        probe_hash = engine.programs.add(probe).hash

        async def example() -> None:
            request = {**speech_case(FOX), "max_seconds": seconds(FOX["frames"])}
            with trio.fail_after(600):
                outcome = await engine.run_inferlet(
                    tts_hash, json.dumps(request), on_event=on_event
                )
            assert outcome.ok, outcome.error
            results["tts"] = json.loads(outcome.result)

        async def run(key: str, request: dict[str, Any]) -> None:
            results[key] = await run_json(engine, probe_hash, request)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(example)
            pair = {
                "probe": "speech",
                "mode": "together",
                "model": "csm",
                "cases": [speech_case(c) for c in PAIR],
            }
            nursery.start_soon(run, "pair", pair)
            text = {
                "probe": "speech",
                "mode": "text",
                "model": "text",
                "prompt": PROMPT,
                "tokens": TOKENS,
            }
            nursery.start_soon(run, "text", text)
        speech = engine.model("csm").speech
        assert speech is not None
        stats = speech.statistics()
    assert results["tts"] == {
        "seconds": pytest.approx(seconds(FOX["frames"])),
        "sample_rate": RATE,
        "channels": 1,
        "bytes": len(sent[0]),
    }
    assert len(sent) == 1
    assert_wav_matches(sent[0], tiny.audio[FOX["text"], FOX["frames"]])
    for got, case in zip(results["pair"], PAIR, strict=True):
        assert got["seconds"] == pytest.approx(seconds(LONG))
        assert_wav_matches(base64.b64decode(got["wav"]), tiny.audio[case["text"], LONG])
    assert results["text"] == tiny.tokens
    assert stats.requests == 3 and stats.active == 0 and stats.failed == 0
    assert stats.most_active >= 2


async def test_refusals_reach_the_program_which_goes_on_speaking(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    probe = built(GUESTS / "media_probe").read_bytes()
    good = {"model": "csm", **speech_case(PIE)}
    cases = [
        {**good, "model": "text"},
        {**good, "text": ""},
        {**good, "speaker": 7},
        {**good, "seconds": 0.0},
        {**good, "seconds": seconds(LONG) * 2},
        {**good, "text": "The quick brown fox. " * 20},
        {**good, "text": "hello <|AUDIO|>"},
        good,
    ]
    async with open_engine(tiny.config) as engine:
        program = engine.programs.add(probe).hash
        seen = await run_json(
            engine, program, {"probe": "speech", "mode": "refusals", "cases": cases}
        )
    assert seen[0] == {
        "kind": "unsupported-media",
        "message": "model 'text' does not speak (it produces text)",
    }
    fields = ["text", "speaker", "max-seconds", "max-seconds", "text", "text"]
    for got, field in zip(seen[1:7], fields, strict=True):
        assert got["kind"] == "invalid" and got["message"].startswith(f"{field}: "), got
    assert "audio context" in seen[6]["message"]
    assert seen[7] == {"seconds": pytest.approx(seconds(PIE["frames"]))}


async def test_the_inferlet_and_user_bounds_refuse_then_serve_once_clips_are_freed(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    """A holds two clips (its bound) and is refused a third; B, of the same user, gets one more
    (the user's third) and is refused the next; once they free theirs both speak again."""
    probe = built(GUESTS / "media_probe").read_bytes()
    common = {
        "probe": "speech",
        "mode": "hold",
        "model": "csm",
        "text": PIE["text"],
        "seconds": 0.002,
    }
    after = {"model": "csm", **speech_case(PIE)}
    results: dict[str, Any] = {}
    async with open_engine(tiny.config) as engine:
        program = engine.programs.add(probe).hash

        async def run(key: str, request: dict[str, Any]) -> None:
            results[key] = await run_json(engine, program, request)

        async with trio.open_nursery() as nursery:
            a = {**common, "count": 3, "signal": "a-held", "wait": "b-done", "case": after}
            b = {**common, "count": 2, "before": "a-held", "signal": "b-done", "case": after}
            nursery.start_soon(run, "a", a)
            nursery.start_soon(run, "b", b)
        assert engine.speech_holds.held("never") == 0
    a_seen, b_seen = results["a"]["seen"], results["b"]["seen"]
    assert a_seen[:2] == [None, None] and a_seen[2]["kind"] == "quota"
    assert "media.max_speech_per_inferlet" in a_seen[2]["message"]
    assert b_seen[0] is None and b_seen[1]["kind"] == "quota"
    assert "media.max_speech_per_user" in b_seen[1]["message"]
    for key in "ab":
        assert results[key]["after"] == {"seconds": pytest.approx(seconds(PIE["frames"]))}
