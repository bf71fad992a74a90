"""Shared by the engine tests of media: a tiny random Qwen2-VL checkpoint written with
transformers (and its processor settings and tokenizer), served beside a tiny text model,
seeded pictures, and transformers' greedy tokens around a picture."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

from pie.config import EngineConfig, config_from_dict
from tests.test_models_qwen2_vl import END, FAMILIES, IMAGE, PROCESSOR, START
from tests.tiny_models import VOCAB, save_tiny_model, write_tiny_tokenizer


def png(seed: int, height: int, width: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def save_tiny_vl(folder: Path, seed: int, chat_template: str | None = None) -> Any:
    """A tiny random Qwen2-VL (weights jittered off their init, so tokens differ between
    pictures) saved with its processor settings and tokenizer; the transformers model."""
    torch.manual_seed(seed)
    reference = Qwen2VLForConditionalGeneration(FAMILIES["qwen2_vl"][1]).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    if chat_template is not None:
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}))
    write_tiny_tokenizer(folder, VOCAB)
    return reference


def vl_beside_text(root: Path, num_pages: int, **sections: Any) -> EngineConfig:
    """An engine config serving `root/vl` as "vl" and a tiny Llama written to `root/text` as
    "text", in float32 on the CPU."""
    save_tiny_model(root / "text", dict(model_type="llama"))
    common = {"dtype": "float32", "device": "cpu"}
    models = [{"name": n, "path": str(root / n), **common} for n in ("vl", "text")]
    kv = {"num_pages": num_pages, "page_size": 4, **sections.pop("kv", {})}
    return config_from_dict({"models": models, "kv": kv, **sections})


def hf_greedy(reference: Any, data: bytes, before: list[int], after: list[int], count: int) -> Any:
    """transformers' `count` greedy tokens after `before`, the picture and `after`."""
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    inputs = Qwen2VLImageProcessorPil(**PROCESSOR)(images=[pixels], return_tensors="pt")
    span = [START, *[IMAGE] * (int(inputs["image_grid_thw"].prod()) // 4), END]
    ids = torch.tensor([[*before, *span, *after]])
    with torch.inference_mode():
        out = reference.generate(
            ids,
            mm_token_type_ids=(ids == IMAGE).int(),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            max_new_tokens=count,
            min_new_tokens=count,
            do_sample=False,
            pad_token_id=0,
        )
    return list(out[0, ids.shape[1] :].tolist())
