"""Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints loaded through pie's
loader: M-RoPE positions equal to get_rope_index, logits for image, video and mixed sequences
within 1e-4 (float32), the vision tower batching items of different sizes, flat config parsing
and the refusals.

transformers' image processor (PIL backend) makes the reference's image inputs; its video
processor needs torchvision, which this environment lacks, so the reference's video inputs come
from pie's preprocess_video (tested against transformers in test_qwen2_vl_processor.py)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from dense_attention import DenseCausalAttention
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from pie.drivers.loader import load_model
from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.models import CausalLM
from pie.drivers.models.media import MediaRows, MediaTowers, PreparedMedia, place_span
from pie.drivers.models.qwen2_vl import MRopeTextModel, mrope_section
from pie.media.audio import DecodedAudio
from pie.media.frames import DecodedVideo, SampledFrame
from pie.media.images import DecodedImage
from pie.media.qwen2_vl import Qwen2VLVision, preprocess_video
from tests.tiny_models import TINY_SHAPE, TINY_TOLERANCE, VOCAB, write_tiny_tokenizer

pytestmark = pytest.mark.unit

IMAGE, VIDEO, START, END = 300, 301, 302, 303
PROCESSOR: dict[str, Any] = dict(
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 64,
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
)
TEXT = dict(
    **TINY_SHAPE,
    bos_token_id=0,
    eos_token_id=1,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
)
VISION_COMMON = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2)
TOKENS: dict[str, Any] = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
)
FAMILIES: dict[str, tuple[type, Any]] = {
    "qwen2_vl": (
        Qwen2VLForConditionalGeneration,
        Qwen2VLConfig(
            text_config=TEXT,
            vision_config=dict(**VISION_COMMON, embed_dim=32, hidden_size=64),
            **TOKENS,
        ),
    ),
    # Windows of 2 x 2 merged blocks (56 pixels), block 0 windowed and block 1 whole frames.
    "qwen2_5_vl": (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLConfig(
            text_config=TEXT,
            vision_config=dict(
                **VISION_COMMON,
                hidden_size=32,
                intermediate_size=48,
                out_hidden_size=64,
                window_size=56,
                fullatt_block_indexes=[1],
                tokens_per_second=2,
            ),
            **TOKENS,
        ),
    ),
}
FRAME_SECONDS = 0.5
"""Spacing of the test videos' frames: Qwen2.5-VL's second_per_grid is 2 * 0.5 = 1 s."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, CausalLM]:
    """(transformers' model, pie's model loaded from what it saved)."""
    model_cls, config = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    reference = model_cls(config).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    write_tiny_tokenizer(folder, VOCAB)
    loaded = load_model(str(folder), torch.float32, "cpu").model
    return reference, loaded


def rgb(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def image(seed: int, height: int = 56, width: int = 84) -> DecodedImage:
    return DecodedImage(pixels=rgb(seed, height, width), format="png", width=width, height=height)


def video(seed: int, frames: int = 3, height: int = 56, width: int = 84) -> DecodedVideo:
    sampled = tuple(
        SampledFrame(pixels=rgb(seed + i, height, width), seconds=i * FRAME_SECONDS, marker="")
        for i in range(frames)
    )
    seconds = frames * FRAME_SECONDS
    return DecodedVideo(frames=sampled, format="gif", width=width, height=height, seconds=seconds)


def no_tokenizer(text: str) -> list[int]:
    raise AssertionError(f"Qwen2-VL's spans are token ids, yet it tokenized {text!r}")


def prepared(model: CausalLM, part: DecodedImage | DecodedVideo) -> PreparedMedia:
    assert isinstance(model, MediaTowers)
    kind = "image" if isinstance(part, DecodedImage) else "video"
    return model.prepare(kind, part, no_tokenizer)


def lay_out(
    model: CausalLM, parts: list[Any]
) -> tuple[torch.Tensor, torch.Tensor, MediaRows, list[PreparedMedia]]:
    """pie's tokens, positions and soft rows for text pieces (token lists) and media."""
    assert isinstance(model, MediaTowers)
    items = [prepared(model, p) for p in parts if not isinstance(p, list)]
    embeds = model.encode(items)
    tokens: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    indices: list[torch.Tensor] = []
    media = iter(items)
    at = 0
    for part in parts:
        if isinstance(part, list):
            tokens += part
            positions += range(at, at + len(part))
            at += len(part)
            continue
        placed = place_span(next(media).span, at)
        rows += [len(tokens) + i for i in placed.soft]
        indices.append(placed.rope_index)
        tokens += placed.tokens
        positions += placed.positions
        at = placed.next_position
    soft = MediaRows(
        rows=torch.tensor(rows), embeds=torch.cat(embeds), rope_index=torch.cat(indices)
    )
    return torch.tensor(tokens), torch.tensor(positions), soft, items


def reference_inputs(ids: torch.Tensor, parts: list[Any]) -> dict[str, torch.Tensor]:
    """transformers' inputs: its PIL image processor's pixels, pie's video patches."""
    images = [p.pixels for p in parts if isinstance(p, DecodedImage)]
    videos = [p for p in parts if isinstance(p, DecodedVideo)]
    inputs: dict[str, torch.Tensor] = dict(
        input_ids=ids[None],
        mm_token_type_ids=((ids == IMAGE).int() + 2 * (ids == VIDEO).int())[None],
    )
    if images:
        processed = Qwen2VLImageProcessorPil(**PROCESSOR)(images=images, return_tensors="pt")
        inputs.update(
            pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"]
        )
        counts = processed["image_grid_thw"].prod(-1) // 4
        assert int(counts.sum()) == int((ids == IMAGE).sum())
    if videos:
        config = Qwen2VLVision.from_preprocessor_config(PROCESSOR)
        patches = [preprocess_video([f.pixels for f in v.frames], config) for v in videos]
        inputs.update(
            pixel_values_videos=torch.cat([torch.from_numpy(p.pixel_values) for p in patches]),
            video_grid_thw=torch.tensor([p.grid_thw for p in patches]),
            second_per_grid_ts=torch.tensor([2 * FRAME_SECONDS] * len(videos)),
        )
    return inputs


def without_unused(reference: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(reference, Qwen2VLForConditionalGeneration):
        return {k: v for k, v in inputs.items() if k != "second_per_grid_ts"}
    return inputs


def text(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, IMAGE, (length,), generator=generator).tolist()


SEQUENCES = {
    "image": lambda: [text(1, 5), image(10), text(2, 4)],
    "video": lambda: [text(1, 3), video(20), text(2, 6)],
    "two-images": lambda: [text(1, 2), image(10), text(2, 3), image(11, 84, 112), text(3, 2)],
    "image-video": lambda: [text(1, 4), image(10, 84, 112), text(2, 3), video(20), text(3, 5)],
}


def test_positions_equal_transformers_rope_index(tiny: tuple[Any, CausalLM]) -> None:
    reference, model = tiny
    parts = SEQUENCES["image-video"]()
    ids, positions, soft, _ = lay_out(model, parts)

    inputs = without_unused(reference, reference_inputs(ids, parts))
    expected, _ = reference.model.get_rope_index(**inputs)

    assert isinstance(model.model, MRopeTextModel)
    streams = model.model.rope_streams(positions, soft)
    assert torch.equal(streams, expected[:, 0].T)


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_logits_match_transformers(tiny: tuple[Any, CausalLM], name: str) -> None:
    reference, model = tiny
    parts = SEQUENCES[name]()
    ids, positions, soft, _ = lay_out(model, parts)

    with torch.inference_mode():
        ours = model.compute_logits(model(ids, positions, DenseCausalAttention(), media=soft))
        theirs = reference(**without_unused(reference, reference_inputs(ids, parts))).logits[0]

    assert theirs.abs().max() > 0.1, "logits too small to reveal a mismatch"
    assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE


def test_text_only_pass_matches_transformers(tiny: tuple[Any, CausalLM]) -> None:
    reference, model = tiny
    ids = torch.tensor(text(5, 20))
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, torch.arange(20), DenseCausalAttention()))
        theirs = reference(input_ids=ids[None]).logits[0]
    assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE


def test_batched_encode_equals_each_alone(tiny: tuple[Any, CausalLM]) -> None:
    _, model = tiny
    assert isinstance(model, MediaTowers)
    items = [prepared(model, m) for m in (image(10), video(20, 5), image(11, 84, 112))]
    with torch.inference_mode():
        together = model.encode(items)
        alone = [model.encode([item])[0] for item in items]
    assert [t.shape[0] for t in together] == [item.soft_count for item in items] == [6, 18, 12]
    for batched, single in zip(together, alone, strict=True):
        assert (batched - single).abs().max().item() <= 1e-5


def test_span_is_start_soft_tokens_end(tiny: tuple[Any, CausalLM]) -> None:
    _, model = tiny
    item = prepared(model, video(20, 3, 84, 112))
    placed = place_span(item.span, 7)
    assert item.grid == (2, 3, 4) and item.soft_count == 24
    assert placed.tokens == [START] + [VIDEO] * 24 + [END]
    assert placed.soft == list(range(1, 25))
    assert placed.positions[:2] == [7, 8] and placed.positions[-1] == 12
    assert placed.next_position == 13


def test_refuses_audio_and_impossible_pictures(tiny: tuple[Any, CausalLM]) -> None:
    _, model = tiny
    assert isinstance(model, MediaTowers)
    family = model.config.model_type
    audio = DecodedAudio(
        samples=np.zeros(160, np.float32), rate=16000, seconds=0.01, format="wav", codec="pcm"
    )
    with pytest.raises(ValueError, match=f"{family} reads \\['image', 'video'\\], not 'audio'"):
        model.prepare("audio", audio, no_tokenizer)
    with pytest.raises(ValueError, match=f"{family} cannot read this image: .*aspect ratio"):
        model.prepare("image", image(1, 2, 600), no_tokenizer)


def test_refuses_a_processor_with_other_patch_sizes(tiny: tuple[Any, CausalLM]) -> None:
    _, model = tiny
    assert isinstance(model, MediaTowers)
    saved = model.processor
    model.processor = {**PROCESSOR, "patch_size": 16}
    try:
        with pytest.raises(
            ValueError, match="disagrees with the vision tower on \\['patch_size'\\]"
        ):
            model.prepare("image", image(1), no_tokenizer)
    finally:
        model.processor = saved


def test_nested_and_flat_configs_parse_alike() -> None:
    nested = FAMILIES["qwen2_vl"][1].to_dict()
    flat = {
        **{k: v for k, v in nested.items() if k != "text_config"},
        **{k: v for k, v in nested["text_config"].items() if k != "rope_parameters"},
        "model_type": "qwen2_vl",
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    }
    for raw in (nested, flat):
        config = model_config_from_hf(raw)
        assert (config.model_type, config.hidden_size, config.num_layers) == ("qwen2_vl", 64, 2)
        assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
        assert (config.rope_theta, config.eos_token_ids, config.vocab_size) == (1e4, (1,), VOCAB)
        assert mrope_section(config) == (2, 3, 3)
        assert config.raw["vision_config"]["embed_dim"] == 32


def test_refuses_an_mrope_section_that_misses_the_head() -> None:
    raw = FAMILIES["qwen2_vl"][1].to_dict()
    raw["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(ValueError, match="mrope_section \\[2, 2, 2\\] must add up to .* \\(8\\)"):
        mrope_section(model_config_from_hf(raw))
