"""Media through the whole engine, the way programs reach it: a picture appended to a context
between two runs of tokens on a tiny random Qwen2-VL, greedy tokens after it equal to
transformers' generate with the same picture, eight pictures at once sharing passes and one
encoder call, and media refused with an error naming the model, the missing tower or what is
wrong with the bytes, the program going on."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any

import pytest

from pie.engine import open_engine
from tests.inferlet_fixtures import GUESTS, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.tiny_media import hf_greedy, png, save_tiny_vl, vl_beside_text

pytestmark = pytest.mark.model

BEFORE, AFTER, TOKENS = [5, 17, 40], [61, 9], 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny Qwen2-VL and a tiny text-only Llama served side by side, and pictures of three
    sizes with transformers' greedy tokens after each."""
    root = tmp_path_factory.mktemp("media")
    reference = save_tiny_vl(root / "vl", seed=0)
    config = vl_beside_text(root, num_pages=512)
    pictures = [png(i, *size) for i, size in enumerate([(56, 84), (84, 112), (60, 60)])]
    expected = [hf_greedy(reference, p, BEFORE, AFTER, TOKENS) for p in pictures]
    at_end = hf_greedy(reference, pictures[1], BEFORE, [], TOKENS)
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
