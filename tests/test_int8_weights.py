"""Linear weights kept in int8 on the CPU (`[model] weights = "int8"`): each layer against its
float32 form, every architecture's logits near transformers' float32 logits, the weight memory
it saves, and on the real default model the share of greedy tokens that agree with float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dense_attention import dense_logits
from torch import nn

from pie.actors.generate import generate, prompt_ids
from pie.config import with_overrides
from pie.drivers.factory import build_torch_driver
from pie.drivers.loader import load_model
from pie.drivers.models.layers import FusedLinear
from pie.drivers.quantize import CALIBRATION, Int8FusedLinear, Int8Linear, quantize_int8
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
def test_smoothing_takes_the_outlier_channels_error_away() -> None:
    """A few input channels a hundred times larger than the rest make one scale per row of
    activations too coarse for the others; smoothing from their observed range fixes it."""
    torch.manual_seed(4)
    layer = nn.Linear(256, 64, bias=False)
    x = torch.randn(16, 256)
    x[:, :4] *= 100.0
    plain = _relative(Int8Linear(layer)(x), layer(x))
    smoothing = (x.abs().amax(0) ** 0.5) / (layer.weight.detach().abs().amax(0) ** 0.5)
    smoothed = _relative(Int8Linear(layer, smoothing)(x), layer(x))
    assert smoothed < plain / 2 and smoothed < INT8_TOLERANCE


@pytest.mark.unit
@pytest.mark.parametrize("name", list(TINY_CASES))
def test_every_architecture_in_int8_stays_near_the_float32_reference(
    tmp_path: Path, name: str
) -> None:
    reference = save_tiny_model(tmp_path, TINY_CASES[name])
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    linears = sum(isinstance(m, nn.Linear) for m in loaded.model.modules())
    calibration = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(2))
    assert quantize_int8(loaded.model, calibration.tolist()) == linears - 1
    left = [n for n, m in loaded.model.named_modules() if isinstance(m, nn.Linear)]
    assert left == ["lm_head"]
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    ours = dense_logits(loaded.model, ids)
    theirs = reference_logits(reference, ids)
    assert _relative(ours, theirs) < 0.05
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.85


@pytest.mark.unit
def test_int8_weights_are_refused_off_the_cpu() -> None:
    from pie.drivers.factory import _weights
    from pie.drivers.select import DriverChoice

    cuda = DriverChoice(driver="torch", device="cuda", dtype=torch.bfloat16, reason="")
    with pytest.raises(ValueError, match="CPU only"):
        _weights(None, "int8", cuda)


@pytest.mark.model
async def test_the_real_model_in_int8_mostly_predicts_what_float32_does(
    real: Any,  # noqa: F811
    default_model_dir: Path,  # noqa: F811
) -> None:
    """Teacher-forced over 300 tokens of prose, the share of positions whose likeliest next
    token is the same in int8 and float32 (printed), and the engine serving the int8 model."""
    config, _, tokenizer = real
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    ids = torch.tensor(tokenizer.encode(text[:1500])[:300])
    fp32 = load_model(str(default_model_dir), torch.float32, "cpu").model
    int8 = load_model(str(default_model_dir), torch.float32, "cpu").model
    quantize_int8(int8, tokenizer.encode(CALIBRATION))
    want, got = (dense_logits(m, ids) for m in (fp32, int8))
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"int8 next-token argmax agreeing with float32: {agreement:.3f} over {len(ids)} tokens")
    assert agreement > 0.8
    assert _relative(got, want) < 0.1
    int8_config = with_overrides(config, model={"weights": "int8"})
    driver, _ = build_torch_driver(int8_config)
    async with open_engine(int8_config, driver=driver, tokenizer=tokenizer) as engine:
        async with engine.requester() as req:
            prompt = prompt_ids(tokenizer, "What is the capital of France?")
            out = await generate(req, prompt, max_tokens=8, sampler=Argmax())
    assert "Paris" in tokenizer.decode(list(out.tokens))
