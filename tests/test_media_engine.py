"""Media through the whole engine, the way programs reach it: a picture appended to a context
between two runs of tokens on a tiny random Qwen2-VL, greedy tokens after it equal to
transformers' generate with the same picture, eight pictures at once sharing passes and one
encoder call, and media refused with an error naming the model, the missing tower or what is
wrong with the bytes, the program going on."""

from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

from pie.config import config_from_dict
from pie.engine import open_engine
from tests.inferlet_fixtures import GUESTS, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.test_models_qwen2_vl import END, FAMILIES, IMAGE, PROCESSOR, START
from tests.tiny_models import VOCAB, save_tiny_model, write_tiny_tokenizer

pytestmark = pytest.mark.model

BEFORE, AFTER, TOKENS = [5, 17, 40], [61, 9], 6


def png(seed: int, height: int, width: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def hf_greedy(reference: Any, data: bytes, after: tuple[int, ...] = tuple(AFTER)) -> list[int]:
    """transformers' greedy tokens after BEFORE, the picture and `after`."""
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    inputs = Qwen2VLImageProcessorPil(**PROCESSOR)(images=[pixels], return_tensors="pt")
    count = int(inputs["image_grid_thw"].prod()) // 4
    ids = [*BEFORE, START, *[IMAGE] * count, END, *after]
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        out = reference.generate(
            tokens,
            mm_token_type_ids=(tokens == IMAGE).int(),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return list(out[0, len(ids) :].tolist())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny Qwen2-VL and a tiny text-only Llama served side by side, and pictures of three
    sizes with transformers' greedy tokens after each."""
    root = tmp_path_factory.mktemp("media")
    torch.manual_seed(0)
    reference = Qwen2VLForConditionalGeneration(FAMILIES["qwen2_vl"][1]).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(root / "vl")
    (root / "vl" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    write_tiny_tokenizer(root / "vl", VOCAB)
    save_tiny_model(root / "text", dict(model_type="llama"))
    pictures = [png(i, *size) for i, size in enumerate([(56, 84), (84, 112), (60, 60)])]
    common = {"dtype": "float32", "device": "cpu"}
    config = config_from_dict(
        {
            "models": [
                {"name": "vl", "path": str(root / "vl"), **common},
                {"name": "text", "path": str(root / "text"), **common},
            ],
            "kv": {"num_pages": 512, "page_size": 4},
        }
    )
    expected = [hf_greedy(reference, p) for p in pictures]
    at_end = hf_greedy(reference, pictures[1], after=())
    return SimpleNamespace(config=config, pictures=pictures, expected=expected, at_end=at_end)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def test_greedy_tokens_after_a_picture_equal_transformers_and_eight_share_passes(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    wasm = built(GUESTS / "media_probe").read_bytes()
    eight = [tiny.pictures[i % 3] for i in range(8)]
    request = {"mode": "describe", "before": BEFORE, "after": AFTER, "tokens": TOKENS}
    async with open_engine(tiny.config) as engine:
        program = engine.programs.add(wasm).hash
        store = engine.model("vl").driver.media
        alone = [
            (await run_json(engine, program, {**request, "images": [b64(p)]}))[0]
            for p in tiny.pictures
        ]
        encodes_alone = store.encodes
        together = await run_json(engine, program, {**request, "images": [b64(p) for p in eight]})
        stats = engine.model("vl").inference.batch_statistics()
        held, cached, _ = store.statistics()
        pages = engine.statistics().models[0].kv
    assert [r["tokens"] for r in alone] == tiny.expected
    assert [r["tokens"] for r in together] == [tiny.expected[i % 3] for i in range(8)]
    assert [r["grid"] for r in alone] == [[1, 2, 3], [1, 3, 4], [1, 2, 2]]
    assert [r["count"] for r in alone] == [6 + 2, 12 + 2, 4 + 2]
    for r in alone:
        assert r["context_tokens"] == len(BEFORE) + r["count"] + len(AFTER) + TOKENS - 1
    # Three pictures, each encoded once; the eight repeats found them in the encoder cache.
    assert encodes_alone == 3 and store.encodes == 3 and cached == 3
    assert held == 0  # every program freed its pictures
    # They share passes; how many meet in one depends on when each program reaches its pass.
    assert stats.max_batch_size >= 2
    assert pages.pages_free == pages.pages_total


async def test_media_a_model_cannot_take_is_refused_naming_it_and_the_program_goes_on(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    wasm = built(GUESTS / "media_probe").read_bytes()
    cases = [
        {"model": "text", "kind": "image", "data": b64(tiny.pictures[0])},
        {"model": "vl", "kind": "audio", "data": b64(b"RIFF....WAVEfmt ")},
        {"model": "vl", "kind": "image", "data": b64(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)},
        {"model": "vl", "kind": "image", "data": b64(b"hello, not a picture")},
        {"model": "vl", "kind": "image", "data": b64(tiny.pictures[2])},
    ]
    async with open_engine(tiny.config) as engine:
        program = engine.programs.add(wasm).hash
        seen = await run_json(engine, program, {"mode": "refusals", "cases": cases})
        after = await run_json(
            engine,
            program,
            {
                "mode": "describe",
                "images": [b64(tiny.pictures[0])],
                "before": BEFORE,
                "after": AFTER,
                "tokens": TOKENS,
            },
        )
    assert seen[0] == {
        "kind": "unsupported-media",
        "message": "model 'text' has no vision tower for image (it reads text)",
    }
    assert seen[1]["kind"] == "unsupported-media" and "no audio tower" in seen[1]["message"]
    assert seen[2]["kind"] == "bad-media" and "image" in seen[2]["message"]
    assert seen[3]["kind"] == "bad-media"
    assert seen[4] is None
    assert after[0]["tokens"] == tiny.expected[0]


async def test_generation_right_after_a_picture_feeds_its_last_token_at_its_own_position(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    """Nothing queued after the picture: the generation's first pass cuts the closing delimiter
    and writes it again, at the position it had (after the picture's largest index), not at the
    soft tokens' last position + 1."""
    wasm = built(GUESTS / "media_probe").read_bytes()
    request = {"mode": "describe", "before": BEFORE, "after": [], "tokens": TOKENS}
    async with open_engine(tiny.config) as engine:
        program = engine.programs.add(wasm).hash
        (seen,) = await run_json(engine, program, {**request, "images": [b64(tiny.pictures[1])]})
    assert seen["tokens"] == tiny.at_end
