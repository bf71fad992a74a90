"""Media in passes that programs build themselves (`Forward.input_image` at an anchor) on a tiny
random Qwen2-VL: greedy tokens equal those after the same pictures appended between fills (and
transformers'), wherever the anchors fall; a media pass with an unknown handle, another model's
medium, an anchor past its tokens or explicit positions is refused and the program goes on."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any

import pytest

from pie.engine import open_engine
from tests.inferlet_fixtures import GUESTS, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.test_media_engine import AFTER, BEFORE
from tests.tiny_media import hf_greedy, png, save_tiny_vl, vl_beside_text

pytestmark = pytest.mark.integration

COUNT = 5
TOKENS = BEFORE + AFTER
ANCHORS = [len(BEFORE), 0, len(TOKENS)]


def greedy_at(reference: Any, data: bytes, anchor: int) -> list[int]:
    """transformers' greedy tokens after TOKENS with the picture before token `anchor`."""
    return list(hf_greedy(reference, data, TOKENS[:anchor], TOKENS[anchor:], COUNT))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny Qwen2-VL beside a tiny text model, two pictures, and transformers' greedy tokens
    after TOKENS with the first picture at each of ANCHORS."""
    root = tmp_path_factory.mktemp("media-passes")
    reference = save_tiny_vl(root / "vl", seed=1)
    config = vl_beside_text(root, num_pages=256)
    pictures = [png(7, 56, 84), png(8, 60, 60)]
    expected = [greedy_at(reference, pictures[0], anchor) for anchor in ANCHORS]
    return SimpleNamespace(config=config, pictures=pictures, expected=expected)


def request(mode: str, pictures: list[bytes], anchors: list[int]) -> dict[str, Any]:
    images = [base64.b64encode(p).decode() for p in pictures]
    return {
        "probe": "passes",
        "mode": mode,
        "images": images,
        "anchors": anchors,
        "tokens": TOKENS,
        "count": COUNT,
    }


async def test_pictures_at_anchors_give_transformers_tokens_and_those_of_appended_pictures(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    wasm = built(GUESTS / "media_probe").read_bytes()
    one, two = tiny.pictures
    async with open_engine(tiny.config) as engine:
        program = engine.programs.add(wasm).hash
        alone = [await run_json(engine, program, request("anchored", [one], [a])) for a in ANCHORS]
        both = [
            await run_json(engine, program, request(mode, [one, two], [1, 4]))
            for mode in ("anchored", "appended")
        ]
        inside = await run_json(engine, program, request("appended", [one], ANCHORS[:1]))
        held, _, _ = engine.model("vl").driver.media.statistics()
    assert [r["tokens"] for r in alone] == tiny.expected
    assert both[0] == both[1] and inside == alone[0]
    # TOKENS and the picture (6 soft tokens, 2 delimiters) in one pass, then the tokens fed
    # back; the 6 soft tokens of the 2 x 3 grid take 3 positions.
    assert [r["written"] for r in alone] == [len(TOKENS) + 8 + COUNT - 1] * 3
    assert [r["next"] for r in alone] == [r["written"] - 3 for r in alone]
    assert held == 0


async def test_bad_media_passes_are_refused_and_the_program_goes_on(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    wasm = built(GUESTS / "media_probe").read_bytes()
    async with open_engine(tiny.config) as engine:
        program = engine.programs.add(wasm).hash
        seen = await run_json(engine, program, request("refusals", tiny.pictures[:1], [3]))
        later = await run_json(engine, program, request("anchored", tiny.pictures[:1], [3]))
    unknown, wrong_model, anchor, positions = seen["refused"]
    assert unknown["kind"] == "no-such-handle"
    assert wrong_model == {
        "kind": "wrong-model",
        "message": "media prepared for model 'vl' cannot go into a context of model 'text'",
    }
    assert anchor == {
        "kind": "invalid",
        "message": "media[0].anchor is 3, outside 0..2 (the pass's tokens)",
    }
    assert positions == {"kind": "invalid", "message": "a pass with media takes no positions"}
    assert seen["written"] == 0
    assert seen["after"]["tokens"] == later["tokens"] == tiny.expected[0]
