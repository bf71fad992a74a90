"""Green-list watermarking through the watermark example on the real default model: sampled
text generated with the watermark's per-step logit bias scores far above chance on the
detector, the same prompt generated without it does not, and another key sees no watermark."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pie.engine import open_engine
from tests.inferlet_fixtures import EXAMPLES, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir, real  # noqa: F401  (fixtures)

pytestmark = pytest.mark.model

PROMPTS = ["Tell me a short story about a lighthouse.", "Describe your favourite season."]


async def test_the_detector_tells_watermarked_text_from_plain_text(
    real: Any,  # noqa: F811
    built: Callable[[Path], Path],  # noqa: F811
) -> None:
    config, driver, tokenizer = real
    wasm = built(EXAMPLES / "watermark").read_bytes()
    scores: dict[str, list[float]] = {"marked": [], "plain": [], "other key": []}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        program = engine.programs.add(wasm).hash
        for i, prompt in enumerate(PROMPTS):
            base = {"prompt": prompt, "max_tokens": 64, "seed": i, "key": 7}
            marked = await run_json(engine, program, base)
            plain = await run_json(engine, program, {**base, "watermark": False})
            for name, text, key in (
                ("marked", marked["text"], 7),
                ("plain", plain["text"], 7),
                ("other key", marked["text"], 8),
            ):
                detected = await run_json(
                    engine, program, {"mode": "detect", "text": text, "key": key}
                )
                scores[name].append(detected["z"])
    print(scores)
    assert all(z > 4.0 for z in scores["marked"])
    assert all(z < 2.0 for z in scores["plain"] + scores["other key"])
