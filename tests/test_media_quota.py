"""The bounds on held media: a program past [media] max_items_per_inferlet and a user whose
programs together hold [media] max_items_per_user on a model are refused with `quota` naming
the key; freeing one, or the other program's end, makes room, another user is unaffected, and
good programs are served throughout."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from transformers import Qwen2VLForConditionalGeneration

from pie.config import config_from_dict
from pie.engine import open_engine
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.test_media_engine import AFTER, BEFORE, png
from tests.test_models_qwen2_vl import FAMILIES, PROCESSOR
from tests.tiny_models import VOCAB, write_tiny_tokenizer

pytestmark = pytest.mark.security

PER_INFERLET = {
    "kind": "quota",
    "message": "this inferlet already holds 2 media items; free one first "
    "(media.max_items_per_inferlet)",
}
PER_USER = {
    "kind": "quota",
    "message": "user 'alice' already holds 3 media items on model 'vl'; free one first "
    "(media.max_items_per_user)",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("media-quota")
    torch.manual_seed(2)
    Qwen2VLForConditionalGeneration(FAMILIES["qwen2_vl"][1]).save_pretrained(root / "vl")
    (root / "vl" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    write_tiny_tokenizer(root / "vl", VOCAB)
    config = config_from_dict(
        {
            "models": [{"name": "vl", "path": str(root / "vl"), "dtype": "float32"}],
            "kv": {"num_pages": 128, "page_size": 4},
            "media": {"max_items_per_inferlet": 2, "max_items_per_user": 3},
        }
    )
    return SimpleNamespace(config=config, picture=base64.b64encode(png(3, 56, 56)).decode())


async def run_as(engine: Any, program: str, user: str, request: dict[str, Any]) -> Any:
    with trio.fail_after(120):
        outcome = await engine.run_inferlet(program, json.dumps(request), user=user)
    assert outcome.ok, outcome.error
    return json.loads(outcome.result)


async def test_held_media_are_bounded_per_inferlet_and_per_user(
    tiny: SimpleNamespace,
    built: Any,  # noqa: F811
) -> None:
    wasm = built(GUESTS / "media_probe").read_bytes()
    hold = {"probe": "passes", "mode": "hold", "images": [tiny.picture]}
    good = {"probe": "passes", "mode": "anchored", "images": [tiny.picture], "anchors": [2]}
    good |= {"tokens": BEFORE + AFTER, "count": 3}
    async with open_engine(tiny.config) as engine:
        program = engine.programs.add(wasm).hash
        store = engine.model("vl").driver.media
        first: list[Any] = []

        async def holder() -> None:
            first.append(await run_as(engine, program, "alice", {**hold, "count": 3, "wait": "go"}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            with trio.fail_after(60):
                while store.held_by("alice") < 2:
                    await trio.sleep(0.01)
            others = await run_as(engine, program, "bob", {**hold, "count": 2})
            served = await run_as(engine, program, "bob", good)
            second = await run_as(
                engine, program, "alice", {**hold, "count": 2, "free_one": True, "signal": "go"}
            )
        after = await run_as(engine, program, "alice", {**hold, "count": 2})
        again = await run_as(engine, program, "alice", good)
        left = store.held_by("alice"), store.statistics()[0]
    assert first == [[None, None, PER_INFERLET]]
    assert others == [None, None]
    # alice's third item fits; her fourth does not until she frees one.
    assert second == [None, PER_USER, None]
    assert after == [None, None]
    assert len(served["tokens"]) == 3 and again == served
    assert left == (0, 0)
