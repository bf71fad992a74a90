"""Idefics3 and SmolVLM against transformers on tiny random checkpoints loaded through pie's
loader: each picture's span equal to the processor's expanded input ids, logits for image+text
(one picture split into crops, two pictures, the unsplit setting), batched encoding equal to
encoding alone, and the refusals."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dense_attention import DenseCausalAttention
from PIL import Image
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    PreTrainedTokenizerFast,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)

from pie.drivers.loader import LoadedModel, load_model
from pie.drivers.models.idefics3 import Idefics3ForConditionalGeneration as PieIdefics3
from pie.drivers.models.media import MediaRows, PreparedMedia, SoftPiece, place_span
from pie.media.idefics3 import IMAGE_TOKEN
from pie.media.images import DecodedImage
from tests.tiny_models import TINY_TOLERANCE

CROP, PATCH, SCALE = 32, 8, 2
PER_CROP = (CROP // PATCH) ** 2 // SCALE**2
PROCESSOR: dict[str, Any] = dict(size={"longest_edge": 96}, max_image_size={"longest_edge": CROP})
SPECIAL = [
    "<|endoftext|>",
    "<fake_token_around_image>",
    IMAGE_TOKEN,
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
# "\n\n" recurs, so the tokenizer merges it: the row ends and the whole picture's lead meet there.
CORPUS = ["Describe the picture.\n\nThen compare them,\nbriefly.\n\n", "What is in it?\n\n"] * 3
TEXT = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration, dict(image_size=CROP)),
    # A position table twice the crop's patch grid (fractional positions), and a tied head.
    "smolvlm-tied": (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        dict(image_size=2 * CROP, tie_word_embeddings=True),
    ),
}
WIDE, TALL = (50, 80), (80, 20)
"""(height, width): 2 x 3 crops and the whole; 3 x 1 crops and the whole."""


def write_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_tiny_vlm(folder: Path, family: str) -> tuple[torch.nn.Module, Idefics3Processor]:
    """A random transformers model of `family` with its tokenizer and image processor saved to
    folder, every weight perturbed off its initial value; and its processor."""
    config_cls, model_cls, extra = FAMILIES[family]
    tokenizer = write_tokenizer(folder)
    tie = extra.get("tie_word_embeddings", False)
    vision = {**VISION, "patch_size": PATCH, "image_size": extra["image_size"]}
    config = config_cls(
        text_config={**TEXT, "vocab_size": len(tokenizer)},
        vision_config=vision,
        scale_factor=SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    images = Idefics3ImageProcessorPil(**PROCESSOR)
    images.save_pretrained(folder)
    return model, Idefics3Processor(images, tokenizer, image_seq_len=PER_CROP)


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[torch.nn.Module, Idefics3Processor, LoadedModel]:
    folder = tmp_path_factory.mktemp(request.param)
    reference, processor = save_tiny_vlm(folder, request.param)
    return reference, processor, load_model(str(folder), torch.float32, "cpu")


def picture(size: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def decoded(pixels: np.ndarray) -> DecodedImage:
    height, width = pixels.shape[:2]
    return DecodedImage(pixels=pixels, format="png", width=width, height=height)


def pie_pass(
    loaded: LoadedModel, prompt: str, pictures: Sequence[np.ndarray]
) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and logits through pie: each image token in the prompt replaced by its
    picture's placed span, the soft rows filled from one batched encode."""
    model = loaded.model
    assert isinstance(model, PieIdefics3)
    items = [model.prepare("image", decoded(p), loaded.tokenizer.encode) for p in pictures]
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    for i, text in enumerate(prompt.split(IMAGE_TOKEN)):
        tokens = loaded.tokenizer.encode(text)
        positions += range(len(ids), len(ids) + len(tokens))
        ids += tokens
        if i < len(items):
            placed = place_span(items[i].span, len(ids))
            rows += [len(ids) + s for s in placed.soft]
            positions += placed.positions
            ids += placed.tokens
    embeds = torch.cat(model.encode(items))
    media = MediaRows(
        rows=torch.tensor(rows),
        embeds=embeds,
        rope_index=torch.zeros(len(rows), 3, dtype=torch.long),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(positions), DenseCausalAttention(), media)
        return ids, model.compute_logits(hidden)


def reference_pass(
    reference: torch.nn.Module,
    processor: Idefics3Processor,
    prompt: str,
    pictures: Sequence[np.ndarray],
) -> tuple[list[int], torch.Tensor]:
    inputs = processor(
        text=[prompt], images=[[Image.fromarray(p) for p in pictures]], return_tensors="pt"
    )
    with torch.inference_mode():
        logits = reference(**inputs).logits[0].float()
    return inputs["input_ids"][0].tolist(), logits


CASES: dict[str, tuple[str, list[tuple[int, int]], dict[str, Any]]] = {
    "one-picture-in-crops": ("Describe <image> briefly.", [WIDE], {}),
    "two-pictures": ("<image>Then compare them,\n<image>\n\nWhat is in it?", [WIDE, TALL], {}),
    "unsplit": ("What is in it?<image>", [TALL], {"do_image_splitting": False}),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", list(CASES))
def test_spans_and_logits_match_transformers(
    tiny: tuple[torch.nn.Module, Idefics3Processor, LoadedModel], case: str
) -> None:
    reference, processor, loaded = tiny
    prompt, sizes, settings = CASES[case]
    pictures = [picture(size, seed) for seed, size in enumerate(sizes)]
    processor.image_processor = Idefics3ImageProcessorPil(**{**PROCESSOR, **settings})
    loaded.model.processor = processor.image_processor.to_dict()

    their_ids, theirs = reference_pass(reference, processor, prompt, pictures)
    our_ids, ours = pie_pass(loaded, prompt, pictures)

    assert our_ids == their_ids
    assert theirs.abs().max() > 0.1, "logits too small to reveal a mismatch"
    assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE


@pytest.mark.unit
def test_a_picture_is_crops_of_soft_tokens_between_text(
    tiny: tuple[torch.nn.Module, Idefics3Processor, LoadedModel],
) -> None:
    _, _, loaded = tiny
    loaded.model.processor = Idefics3ImageProcessorPil(**PROCESSOR).to_dict()
    item = prepare(loaded, WIDE)
    soft = [p for p in item.span if isinstance(p, SoftPiece)]
    assert [p.count for p in soft] == [PER_CROP] * 7
    assert item.grid == (7, 2, 2) and item.soft_count == 7 * PER_CROP
    assert all(torch.equal(p.rope_index[:, 0], torch.arange(PER_CROP)) for p in soft)
    assert item.inputs["pixel_values"].shape == (7, 3, CROP, CROP)


@pytest.mark.unit
def test_batched_encoding_equals_encoding_alone(
    tiny: tuple[torch.nn.Module, Idefics3Processor, LoadedModel],
) -> None:
    _, _, loaded = tiny
    loaded.model.processor = Idefics3ImageProcessorPil(**PROCESSOR).to_dict()
    model = loaded.model
    assert isinstance(model, PieIdefics3)
    items = [prepare(loaded, WIDE), prepare(loaded, TALL, seed=1), prepare(loaded, WIDE, seed=2)]
    assert [item.grid[0] for item in items] == [7, 4, 7]
    with torch.inference_mode():
        together = model.encode(items)
        alone = [model.encode([item])[0] for item in items]
    for batched, single, item in zip(together, alone, items, strict=True):
        assert batched.shape == (item.soft_count, model.config.hidden_size)
        assert (batched - single).abs().max().item() <= 1e-5


@pytest.mark.unit
def test_media_it_does_not_read_and_bad_sizes_are_refused(
    tiny: tuple[torch.nn.Module, Idefics3Processor, LoadedModel],
) -> None:
    _, _, loaded = tiny
    model = loaded.model
    assert isinstance(model, PieIdefics3)
    encode = loaded.tokenizer.encode
    for kind in ("audio", "video"):
        with pytest.raises(
            ValueError, match=f"Idefics3/SmolVLM models read images only, not '{kind}'"
        ):
            model.prepare(kind, None, encode)
    model.processor = {
        **Idefics3ImageProcessorPil(**PROCESSOR).to_dict(),
        "max_image_size": {"longest_edge": 36},
    }
    with pytest.raises(ValueError, match="Idefics3/SmolVLM: crop size 36 is not a multiple of"):
        model.prepare("image", decoded(picture(WIDE, 0)), encode)
    model.processor = Idefics3ImageProcessorPil(**PROCESSOR).to_dict()
    with pytest.raises(ValueError, match="Idefics3/SmolVLM: expected RGB uint8"):
        model.prepare("image", decoded(np.zeros((4, 4), np.uint8)), encode)
    with pytest.raises(
        ValueError, match="does not encode '<image>' as the config's image_token_id"
    ):
        model.prepare("image", decoded(picture(WIDE, 0)), lambda text: [1, 2, 3])


def prepare(loaded: LoadedModel, size: tuple[int, int], seed: int = 0) -> PreparedMedia:
    model = loaded.model
    assert isinstance(model, PieIdefics3)
    return model.prepare("image", decoded(picture(size, seed)), loaded.tokenizer.encode)
