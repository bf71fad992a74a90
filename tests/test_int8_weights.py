"""Linear weights kept in int8 on the CPU (`[model] weights = "int8"`): each layer against its
float32 form, every architecture's logits near transformers' float32 logits, the weight memory
it saves, and on the real default model the share of greedy tokens that agree with float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dense_attention import DenseCausalAttention
from torch import nn

from pie.actors.generate import generate, prompt_ids
from pie.config import with_overrides
from pie.drivers.factory import build_torch_driver
from pie.drivers.loader import load_model
from pie.drivers.models.layers import FusedLinear
from pie.drivers.quantize import Int8FusedLinear, Int8Linear, quantize_int8
from pie.engine import open_engine
from pie.events.sampling import Argmax
from tests.model_fixtures import default_model_dir, real  # noqa: F401  (fixtures)
from tests.tiny_models import TINY_CASES, VOCAB, reference_logits, save_tiny_model

INT8_TOLERANCE = 0.02
"""Relative error (Frobenius norm) of one int8 layer against float32: per-row scales for both
weights and activations keep it near 0.5-1% on random data; 2% leaves room."""


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm() / want.norm()).detach())


@pytest.mark.unit
@pytest.mark.parametrize(
    ("rows", "inputs", "outputs", "bias"),
    [(1, 64, 96, True), (5, 576, 960, False), (33, 24, 10, True), (1, 7, 3, False)],
)
def test_an_int8_layer_is_close_to_its_float32_form(
    rows: int, inputs: int, outputs: int, bias: bool
) -> None:
    torch.manual_seed(rows + inputs)
    layer = nn.Linear(inputs, outputs, bias=bias)
    x = torch.randn(rows, inputs)
    quantized = Int8Linear(layer)
    assert quantized.qweight.dtype == torch.int8
    assert _relative(quantized(x), layer(x)) < INT8_TOLERANCE
    assert quantized(x.reshape(1, rows, inputs)).shape == (1, rows, outputs)


@pytest.mark.unit
def test_a_fused_projection_splits_the_same_way_in_int8() -> None:
    torch.manual_seed(2)
    fused = FusedLinear(64, [("q", 32), ("k", 16), ("v", 16)], bias=True)
    x = torch.randn(3, 64)
    parts = Int8FusedLinear(fused).forward_split(x)
    assert [p.shape[-1] for p in parts] == [32, 16, 16]
    for got, want in zip(parts, fused.forward_split(x), strict=True):
        assert _relative(got, want) < INT8_TOLERANCE


@pytest.mark.unit
def test_a_zero_row_or_input_gives_zeros_not_nans() -> None:
    layer = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        layer.weight[1].zero_()
    quantized = Int8Linear(layer)
    assert torch.equal(quantized(torch.zeros(2, 8)), torch.zeros(2, 4))
    assert torch.isfinite(quantized(torch.randn(2, 8))).all()


@pytest.mark.unit
@pytest.mark.parametrize("name", list(TINY_CASES))
def test_every_architecture_in_int8_stays_near_the_float32_reference(
    tmp_path: Path, name: str
) -> None:
    reference = save_tiny_model(tmp_path, TINY_CASES[name])
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    linears = sum(isinstance(m, nn.Linear) for m in loaded.model.modules())
    assert quantize_int8(loaded.model) == linears
    assert not any(isinstance(m, nn.Linear) for m in loaded.model.modules())
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        hidden = loaded.model(ids, torch.arange(48), DenseCausalAttention())
        ours = loaded.model.compute_logits(hidden)
    theirs = reference_logits(reference, ids)
    assert _relative(ours, theirs) < 0.05
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.85


@pytest.mark.unit
def test_int8_weights_are_refused_off_the_cpu() -> None:
    from pie.drivers.factory import _quantize

    with pytest.raises(ValueError, match="CPU only"):
        _quantize(nn.Linear(2, 2), "int8", "cuda")


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in one sentence.",
    "List three primary colours.",
]


@pytest.mark.model
async def test_greedy_tokens_in_int8_mostly_agree_with_float32(
    real: Any,  # noqa: F811
) -> None:
    """The agreement rate is printed; greedy decoding diverges for good at the first token that
    differs, so it is counted up to there."""
    config, driver, tokenizer = real
    int8_config = with_overrides(config, model={"weights": "int8"})
    int8_driver, _ = build_torch_driver(int8_config)
    outputs: dict[str, list[list[int]]] = {}
    for label, cfg, drv in (("fp32", config, driver), ("int8", int8_config, int8_driver)):
        async with open_engine(cfg, driver=drv, tokenizer=tokenizer) as engine:
            async with engine.requester() as req:
                outputs[label] = [
                    list(
                        (
                            await generate(
                                req, prompt_ids(tokenizer, p), max_tokens=24, sampler=Argmax()
                            )
                        ).tokens
                    )
                    for p in PROMPTS
                ]
    agreed = [
        _common_prefix(a, b) / max(len(a), 1)
        for a, b in zip(outputs["fp32"], outputs["int8"], strict=True)
    ]
    print(f"int8 greedy tokens agreeing with float32 (prefix share per prompt): {agreed}")
    assert sum(agreed) / len(agreed) >= 0.5
    assert all(a[:2] == b[:2] for a, b in zip(outputs["fp32"], outputs["int8"], strict=True))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
