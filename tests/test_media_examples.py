"""The image-qa, video-qa and audio-qa examples end to end on one engine serving a tiny random
Qwen2-VL and a tiny random Qwen2-Audio, each with a chat template shaped like its real one: the
greedy tokens equal transformers' `generate` on the processor's input ids (transformers' render
of the same chat, each placeholder expanded) with the same pixels or features; a system message
and text on both sides of the medium land where the template puts them; audio sent to the vision
model and a URL the default network policy denies are refused by name, the engine serving the
next request."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import av
import numpy as np
import pytest
import torch
import trio
from PIL import Image
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)

from pie.config import config_from_dict
from pie.drivers.factory import build_drivers
from pie.engine import open_engine
from pie.media.qwen2_vl import Qwen2VLVision, preprocess_video
from tests.inferlet_fixtures import EXAMPLES, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import components_dir
from tests.test_models_qwen2_vl import PROCESSOR
from tests.tiny_models import TINY_SHAPE, VOCAB, write_tiny_tokenizer

pytestmark = pytest.mark.model

TOKENS = 8
CHAT = ["<|im_start|>", "<|im_end|>"]
VL_TOKENS = [*CHAT, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
AUDIO_TOKENS = [*CHAT, "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
# The shape of Qwen2-VL-Instruct's template: a default system message, typed parts.
VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The shape of Qwen2-Audio-Instruct's: each clip numbered, on a line of its own.
AUDIO_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FRAMES, FRAME_RATE = 4, 2
RATE = 16000


def tokenizer_with(folder: Path, specials: list[str]) -> PreTrainedTokenizerFast:
    write_tiny_tokenizer(folder, VOCAB)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.save_pretrained(folder)
    return tokenizer


def perturbed(model: Any) -> Any:
    """The model with every weight moved off its initial value."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def text_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    ends = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    return {
        **TINY_SHAPE,
        "vocab_size": len(tokenizer),
        "bos_token_id": ends[0],
        "eos_token_id": ends[1],
    }


def save_vl(folder: Path) -> tuple[Any, PreTrainedTokenizerFast]:
    """A tiny Qwen2-VL whose template comes as a processor's chat_template.json."""
    tokenizer = tokenizer_with(folder, VL_TOKENS)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={
            **text_config(tokenizer),
            "rope_parameters": dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3]),
        },
        vision_config=dict(
            depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, embed_dim=32, hidden_size=64
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = perturbed(Qwen2VLForConditionalGeneration(config))
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": VL_TEMPLATE}))
    return model, tokenizer


def save_audio(folder: Path) -> tuple[Any, Qwen2AudioProcessor]:
    """A tiny Qwen2-Audio whose template comes as chat_template.jinja."""
    tokenizer = tokenizer_with(folder, AUDIO_TOKENS)
    config = Qwen2AudioConfig(
        text_config=dict(model_type="qwen2", **text_config(tokenizer)),
        audio_config=dict(
            model_type="qwen2_audio_encoder",
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            num_mel_bins=128,
            max_source_positions=1500,
        ),
        audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
    )
    torch.manual_seed(1)
    model = perturbed(Qwen2AudioForConditionalGeneration(config))
    model.save_pretrained(folder)
    features = WhisperFeatureExtractor(feature_size=128)
    features.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(AUDIO_TEMPLATE)
    return model, Qwen2AudioProcessor(feature_extractor=features, tokenizer=tokenizer)


def png(seed: int, height: int, width: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def mp4(seed: int, height: int = 56, width: int = 84) -> bytes:
    """FRAMES random frames, FRAME_RATE a second, as MPEG-4 video in an MP4 file."""
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=FRAME_RATE)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(FRAMES):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def wav(seed: int, seconds: float) -> bytes:
    samples = np.random.default_rng(seed).integers(-20000, 20000, round(seconds * RATE))
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(RATE)
        file.writeframes(samples.astype("<i2").tobytes())
    return out.getvalue()


def chat(kind: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages an example builds from `request`, as transformers' processors take them."""
    parts = [{"type": "text", "text": request["before"]}] if request.get("before") else []
    parts += [{"type": kind, kind: ""}, {"type": "text", "text": request["question"]}]
    system = [{"role": "system", "content": request["system"]}] if request.get("system") else []
    return [*system, {"role": "user", "content": parts}]


def expand(text: str, placeholder: str, counts: list[int]) -> str:
    """Each placeholder repeated as many times as its medium has soft tokens, in order, as
    transformers' Qwen2-VL processor does."""
    first, *rest = text.split(placeholder)
    return first + "".join(placeholder * n + after for n, after in zip(counts, rest, strict=True))


def vl_inputs(tokenizer: Any, kind: str, data: bytes, request: dict[str, Any]) -> dict[str, Any]:
    """transformers' inputs: its PIL image processor's pixels; for video (its video processor
    needs torchvision, absent here) pie's patches of every frame av decodes."""
    text = tokenizer.apply_chat_template(
        chat(kind, request), tokenize=False, add_generation_prompt=True, chat_template=VL_TEMPLATE
    )
    if kind == "image":
        pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        processed = Qwen2VLImageProcessorPil(**PROCESSOR)(images=[pixels], return_tensors="pt")
        media = dict(
            pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"]
        )
        grid = processed["image_grid_thw"]
    else:
        with av.open(io.BytesIO(data)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        patches = preprocess_video(frames, Qwen2VLVision.from_preprocessor_config(PROCESSOR))
        grid = torch.tensor([patches.grid_thw])
        media = dict(
            pixel_values_videos=torch.from_numpy(patches.pixel_values), video_grid_thw=grid
        )
    pad = f"<|{kind}_pad|>"
    ids = tokenizer(expand(text, pad, [int(grid.prod()) // 4]), return_tensors="pt").input_ids
    types = (ids == tokenizer.convert_tokens_to_ids(pad)).int() * (1 if kind == "image" else 2)
    return dict(input_ids=ids, mm_token_type_ids=types, **media)


def audio_inputs(processor: Any, data: bytes, request: dict[str, Any]) -> dict[str, Any]:
    text = processor.tokenizer.apply_chat_template(
        chat("audio", request),
        tokenize=False,
        add_generation_prompt=True,
        chat_template=AUDIO_TEMPLATE,
    )
    with wave.open(io.BytesIO(data)) as file:
        samples = np.frombuffer(file.readframes(file.getnframes()), "<i2") / 32768.0
    return dict(
        processor(
            text=text, audio=[samples.astype(np.float32)], sampling_rate=RATE, return_tensors="pt"
        )
    )


def greedy(reference: Any, inputs: dict[str, Any], stops: frozenset[int]) -> list[int]:
    """transformers' greedy tokens, up to (not including) the first stop token."""
    with torch.inference_mode():
        out = reference.generate(
            **inputs,
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    ends = [i for i, t in enumerate(tokens) if t in stops]
    return tokens[: ends[0]] if ends else tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> SimpleNamespace:
    """The two models loaded once into drivers that every test's engine serves, and their
    transformers twins."""
    root = tmp_path_factory.mktemp("media-examples")
    vl, vl_tokenizer = save_vl(root / "vl")
    audio, processor = save_audio(root / "audio")
    common = {"dtype": "float32", "device": "cpu"}
    config = config_from_dict(
        {
            "models": [
                {"name": "vl", "path": str(root / "vl"), **common},
                {"name": "audio", "path": str(root / "audio"), **common},
            ],
            "kv": {"num_pages": 512, "page_size": 4},
            "sandbox": {"cache_dir": components_dir(pytestconfig)},
        }
    )
    served = build_drivers(config)
    stops = {d.info.model_name: frozenset(t.stop_token_ids) for d, t in served}
    return SimpleNamespace(
        config=config,
        served=served,
        stops=stops,
        vl=vl,
        vl_tokenizer=vl_tokenizer,
        audio=audio,
        processor=processor,
    )


@pytest.fixture(scope="module")
def examples(built: Any) -> dict[str, bytes]:  # noqa: F811
    return {
        name: built(EXAMPLES / name).read_bytes() for name in ("image-qa", "video-qa", "audio-qa")
    }


@contextlib.asynccontextmanager
async def serving(tiny: SimpleNamespace, examples: dict[str, bytes]) -> AsyncIterator[Any]:
    """An engine on the loaded models with the examples installed: `run(example, request)`
    returns a result, `refused(example, request)` the error of a program that failed."""
    async with open_engine(tiny.config, served=tiny.served) as engine:
        programs = {name: engine.programs.add(wasm).hash for name, wasm in examples.items()}

        async def run(example: str, request: dict[str, Any]) -> Any:
            return await run_json(engine, programs[example], request, seconds=60)

        async def refused(example: str, request: dict[str, Any]) -> str:
            with trio.fail_after(60):
                outcome = await engine.run_inferlet(programs[example], json.dumps(request))
            assert not outcome.ok
            return str(outcome.error)

        yield SimpleNamespace(run=run, refused=refused)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def expected_vl(tiny: SimpleNamespace, kind: str, data: bytes, request: dict[str, Any]) -> Any:
    inputs = vl_inputs(tiny.vl_tokenizer, kind, data, request)
    return greedy(tiny.vl, inputs, tiny.stops["vl"])


async def test_image_video_and_audio_answers_equal_transformers_greedy(
    tiny: SimpleNamespace, examples: dict[str, bytes]
) -> None:
    picture, clip, sound = png(1, 56, 84), mp4(2), wav(3, 1.3)
    ask = {"max_tokens": TOKENS}
    image = {**ask, "question": "What is in it?"}
    video = {**ask, "question": "What happens?", "max_frames": FRAMES}
    audio = {**ask, "question": "What is said?"}
    async with serving(tiny, examples) as engine:
        answers = [
            await engine.run("image-qa", {**image, "image": b64(picture)}),
            await engine.run("video-qa", {**video, "video": b64(clip)}),
            await engine.run("audio-qa", {**audio, "audio": b64(sound)}),
        ]
    audio_inputs_ = audio_inputs(tiny.processor, sound, audio)
    expected = [
        expected_vl(tiny, "image", picture, image),
        expected_vl(tiny, "video", clip, video),
        greedy(tiny.audio, audio_inputs_, tiny.stops["audio"]),
    ]
    assert [a["tokens"] for a in answers] == expected
    assert [len(e) for e in expected] == [TOKENS] * 3, "a stop token cut a reference short"
    soft_audio = int((audio_inputs_["input_ids"] == tiny.processor.audio_token_id).sum())
    assert [a["grid"] for a in answers] == [[1, 2, 3], [2, 2, 3], [1, 1, soft_audio]]
    assert [a["media_tokens"] for a in answers] == [6 + 2, 12 + 2, soft_audio + 2]
    decode = [tiny.vl_tokenizer.decode] * 2 + [tiny.processor.tokenizer.decode]
    assert [a["text"] for a in answers] == [d(e) for d, e in zip(decode, expected, strict=True)]


async def test_a_system_message_and_text_around_the_medium_go_where_the_template_puts_them(
    tiny: SimpleNamespace, examples: dict[str, bytes]
) -> None:
    picture = png(4, 84, 112)
    request = {
        "system": "Answer in one word.",
        "before": "Here is a photo.",
        "question": "Which colour is most common?",
        "max_tokens": TOKENS,
    }
    async with serving(tiny, examples) as engine:
        answer = await engine.run("image-qa", {**request, "image": b64(picture)})
    expected = expected_vl(tiny, "image", picture, request)
    assert answer["tokens"] == expected and len(expected) == TOKENS
    assert answer["grid"] == [1, 3, 4]


async def test_audio_for_the_vision_model_and_a_denied_url_are_refused_and_serving_goes_on(
    tiny: SimpleNamespace, examples: dict[str, bytes]
) -> None:
    picture = png(5, 56, 56)
    request = {"question": "What is in it?", "max_tokens": TOKENS}
    async with serving(tiny, examples) as engine:
        wrong_tower = await engine.refused(
            "audio-qa", {**request, "model": "vl", "audio": b64(wav(6, 0.5))}
        )
        denied = await engine.refused(
            "image-qa", {**request, "url": "https://pictures.example.com/cat.png"}
        )
        served = await engine.run("image-qa", {**request, "image": b64(picture)})
    assert "unsupported-media: model 'vl' has no audio tower for audio" in wrong_tower
    assert "denied: the network policy does not allow 'pictures.example.com'" in denied
    assert served["tokens"] == expected_vl(tiny, "image", picture, request)
