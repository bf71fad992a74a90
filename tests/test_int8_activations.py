"""int4 weights in 16-row tiles, whose inputs multiply as int8 blocks (`[model] activations`):
the kernel against a float64 reference of the same arithmetic on every build variant, each row
computed as it would be alone, the tile layout, the settings' refusals, and the real model's
outputs against float32 activations, alone and batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dense_attention import dense_logits

from pie.config import with_overrides
from pie.drivers import tiles as tiles_module
from pie.drivers.factory import _quantize, build_torch_driver
from pie.drivers.gguf_blocks import Q4Blocks, Q8Blocks, quantize_blocks, quantize_blocks8
from pie.drivers.kernels import q4_ops
from pie.drivers.loader import load_model
from pie.drivers.q8_head import Q8Embedding, Q8Linear, quantize_head
from pie.drivers.quantize4 import Int4Linear, quantize_int4
from pie.drivers.tiles import int8_activations, tile, untile
from tests.engine_greedy import engine_greedy
from tests.kernel_variants import VARIANTS
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

ROUNDING = 1e-5
"""Relative error allowed where only the order of float32 additions differs."""
SHAPES = [(960, 576), (576, 1536), (112, 96), (64, 224)]
"""(rows, inputs): the default model's layer shapes, and odd block counts (3 and 7)."""


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs().max() / want.abs().max()).detach())


def _int8_reference(x: torch.Tensor, blocks: Q4Blocks | Q8Blocks) -> torch.Tensor:
    """x W^T in float64 as the kernel defines it: each block of 32 values of x as round(x / dx)
    with dx = max|x| / 127, dotted exactly with W's levels, times d_w * dx, plus Q4_1's m_w
    times the block's sum of x."""
    rows, inputs = blocks.shape
    groups = x.double().reshape(len(x), inputs // 32, 32)
    dx = groups.abs().amax(-1, keepdim=True) / 127
    levels = torch.round(groups / torch.where(dx > 0, dx, 1.0))
    if isinstance(blocks, Q8Blocks):
        weight_levels = blocks.packed.reshape(rows, inputs // 32, 32).double()
        d = blocks.scales.double()[..., 0]
        return torch.einsum("nbi,tbi,nb,tb->tn", weight_levels, levels, d, dx[..., 0])
    nibbles = blocks.packed.reshape(rows, inputs // 32, 16)
    weight_levels = torch.cat([nibbles & 15, nibbles >> 4], -1).double()
    d, m = blocks.scales.double().unbind(-1)
    dots = torch.einsum("nbi,tbi,nb,tb->tn", weight_levels, levels, d, dx[..., 0])
    return dots + torch.einsum("nb,tb->tn", m, groups.sum(-1))


@pytest.mark.unit
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_multiplies_tiles_with_int8_rows_as_the_reference_does(variant: str) -> None:
    ops = q4_ops(variant)
    torch.manual_seed(0)
    for rows, inputs in SHAPES:
        weight = torch.randn(rows, inputs)
        for blocks, linear in (
            (quantize_blocks(weight), ops.linear_tiled),
            (quantize_blocks8(weight), ops.linear8_tiled),
        ):
            tiled = tile(blocks)
            for tokens in (1, 3, 8, 11):
                x = torch.randn(tokens, inputs)
                got = linear(x, tiled.packed, tiled.scales)
                want = _int8_reference(x, blocks)
                assert _relative(got.double(), want) < ROUNDING, (variant, rows, inputs, tokens)


@pytest.mark.unit
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_row_gives_what_it_gives_alone_and_tiles_dequantize_to_their_blocks(
    variant: str,
) -> None:
    """A token's output does not depend on the pass or batch it is in: 50 rows at once (a
    prefill) equal each row multiplied alone (a decode step), bit for bit."""
    ops = q4_ops(variant)
    torch.manual_seed(1)
    weight = torch.randn(960, 576)
    x = torch.randn(50, 576)
    four, eight = quantize_blocks(weight), quantize_blocks8(weight)
    t4, t8 = tile(four), tile(eight)
    assert torch.equal(ops.dequantize_tiled(t4.packed, t4.scales), four.dequantize())
    assert torch.equal(ops.dequantize8_tiled(t8.packed, t8.scales), eight.dequantize())
    for blocks, tiled, linear in ((four, t4, ops.linear_tiled), (eight, t8, ops.linear8_tiled)):
        together = linear(x, tiled.packed, tiled.scales)
        alone = torch.cat([linear(x[i : i + 1], tiled.packed, tiled.scales) for i in range(50)])
        assert torch.equal(together, alone)
        assert _relative(together.double(), _int8_reference(x, blocks)) < ROUNDING
    ids = torch.tensor([0, 959, 17, 17])
    assert torch.equal(ops.rows8_tiled(t8.packed, t8.scales, ids), eight.dequantize()[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rows8_tiled(t8.packed, t8.scales, torch.tensor([960]))


@pytest.mark.unit
def test_tiles_hold_the_same_bytes_and_give_them_back() -> None:
    weight = torch.randn(48, 64)
    for blocks in (quantize_blocks(weight), quantize_blocks8(weight)):
        tiled = tile(blocks)
        assert tiled.shape == blocks.shape
        assert tiled.packed.numel() == blocks.packed.numel()
        assert tiled.scales.numel() == blocks.scales.numel()
        back = untile(tiled)
        assert type(back) is type(blocks)
        assert torch.equal(back.packed, blocks.packed)
        assert torch.equal(back.scales, blocks.scales)
    with pytest.raises(ValueError, match="16 rows"):
        tile(quantize_blocks(torch.randn(40, 64)))


@pytest.mark.unit
def test_layers_whose_rows_do_not_fill_tiles_keep_their_blocks() -> None:
    ragged = Int4Linear(torch.nn.Linear(64, 40), tiled=True)
    whole = Int4Linear(torch.nn.Linear(64, 48), tiled=True)
    assert (ragged.tiled, whole.tiled) == (False, True)
    x = torch.randn(2, 64)
    for layer in (ragged, whole):
        assert layer(x).shape == (2, layer.out_features)


@pytest.mark.unit
def test_int8_activations_without_vnni_and_outside_int4_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class NoVnni:
        def int8_dot(self) -> bool:
            return False

        def isa(self) -> str:
            return "avx2"

    monkeypatch.setattr("pie.drivers.kernels.q4_ops", lambda: NoVnni())
    assert int8_activations("float32") is False
    with pytest.raises(ValueError, match="AVX-512 VNNI.*avx2"):
        int8_activations("int8")
    with pytest.raises(ValueError, match="must be one of"):
        int8_activations("auto")
    with pytest.raises(ValueError, match="applies to int4 weights"):
        _quantize(None, "dtype", None, "int8")
    assert tiles_module.ACTIVATIONS == ("float32", "int8")


@pytest.mark.model
def test_the_real_model_with_int8_rows_mostly_predicts_what_float32_rows_do(
    default_model_dir: Path,  # noqa: F811
) -> None:
    """Teacher-forced over 300 tokens of prose, rows as int8 blocks against float32 rows on the
    same Q4_1 blocks (printed: the share of positions with the same likeliest token, the
    logits' error and the text's mean log-probability)."""
    if not q4_ops().int8_dot():
        pytest.skip("the int8 row kernel needs AVX-512 VNNI")
    models = []
    for tiled in (False, True):
        loaded = load_model(str(default_model_dir), torch.float32, "cpu")
        quantize_int4(loaded.model, default_model_dir, tiled=tiled)
        quantize_head(loaded.model, tiled=tiled)
        models.append(loaded.model)
    assert isinstance(models[1].model.embed_tokens, Q8Embedding)
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    ids = torch.tensor(loaded.tokenizer.encode(text[:1500])[:300])
    exact, int8 = (dense_logits(model, ids) for model in models)
    agreement = float((int8.argmax(-1) == exact.argmax(-1)).float().mean())
    error = float((int8 - exact).norm() / exact.norm())

    def mean_logprob(logits: torch.Tensor) -> float:
        return float(torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None]).mean())

    print(
        f"int8 rows: argmax agreement {agreement:.3f}, logits error {error:.4f}, mean log-prob "
        f"{mean_logprob(int8):.3f} (float32 rows {mean_logprob(exact):.3f})"
    )
    assert agreement > 0.85
    assert error < 0.08
    assert abs(mean_logprob(int8) - mean_logprob(exact)) < 0.05


@pytest.mark.model
async def test_the_engine_with_int8_rows_gives_each_context_the_same_tokens_alone_and_batched(
    default_model_dir: Path,  # noqa: F811
) -> None:
    """Tiled layers when int8 is asked for (exact ones otherwise), and greedy tokens that do not
    depend on what else is in the batch."""
    if not q4_ops().int8_dot():
        pytest.skip("the int8 row kernel needs AVX-512 VNNI")
    from pie.config import EngineConfig

    base = with_overrides(
        EngineConfig(),
        model={"path": str(default_model_dir), "weights": "int4"},
        kv={"num_pages": 256},
    )
    for activations, tiled in {"float32": False, "int8": True}.items():
        config = with_overrides(base, model={"activations": activations})
        driver, _ = build_torch_driver(config)
        layers = [m for m in driver.model.modules() if isinstance(m, Int4Linear)]
        assert len(layers) == 30 * 4
        assert {layer.tiled for layer in layers} == {tiled}
        assert isinstance(driver.model.lm_head, Q8Linear)
        assert driver.model.lm_head.tiled == tiled
    tokenizer = load_model(str(default_model_dir), torch.float32, "cpu").tokenizer
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "1, 2, 3, 4,")]
    run = await engine_greedy(config, prompts, 12, copies=4)
    assert run.together == [run.alone[i % 2] for i in range(4)]
    assert run.stats.scheduler.max_batch_size >= 4
