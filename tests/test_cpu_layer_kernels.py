"""The compiled CPU layer kernels (kernels/layer_ops.cpp through cpu_layers.CpuLayerKernels):
each op of each instruction-set variant against the torch version, what falls back to torch and
what is refused, whole tiny models against their torch-op logits, and the torch driver's
choice of kernels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dense_attention import dense_logits

from pie.drivers import cpu_layers
from pie.drivers.cpu_layers import CpuLayerKernels, cpu_layer_kernels
from pie.drivers.kernels import KernelBuildError, kernel_ops
from pie.drivers.loader import load_model
from pie.drivers.models.layers import TORCH_KERNELS, LayerKernels, RotaryEmbedding
from pie.drivers.torch_driver import TorchDriver
from tests.kernel_variants import VARIANTS
from tests.tiny_models import TINY_CASES, VOCAB, save_tiny_model

ROUNDING = 1e-6
"""Relative error (Frobenius norm) allowed where only the order of float32 additions (the sum
of squares) or a fused multiply-add differs from torch's."""
LOGITS = 1e-5
"""Max abs logit difference between a tiny model on the kernels and on the torch ops."""

TOKENS = [1, 37]
WIDTHS = [576, 64, 100]
"""SmolLM2's hidden size and head size, and one that leaves a scalar tail at every width."""
MODEL_CASES: dict[str, dict[str, Any]] = {
    **TINY_CASES,
    "phi3-half-rotary": dict(model_type="phi3", pad_token_id=0, partial_rotary_factor=0.5),
    "olmo2-post-norm": dict(model_type="olmo2", eos_token_id=None),
    "gemma3-per-head-norms": dict(
        model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=20, sliding_window=6
    ),
}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _kernels(variant: str) -> CpuLayerKernels:
    return CpuLayerKernels(kernel_ops("layer", variant))


def _qk(tokens: int, heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the model has them: views into one fused projection output, so that rows of
    one token are dense and tokens are strided."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    return q, k


@pytest.mark.unit
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_is_built_for_its_instruction_set(variant: str) -> None:
    isa = kernel_ops("layer", variant).isa()
    assert isa == {"avx2": "avx2", "portable": "portable"}.get(variant, isa)


@pytest.mark.unit
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_torch(variant: str, tokens: int, width: int) -> None:
    x, weight = torch.randn(tokens, width) * 3, torch.randn(width)
    with torch.inference_mode():
        got = _kernels(variant).rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape
    assert _relative(got, TORCH_KERNELS.rms_norm(x, weight, 1e-5)) < ROUNDING


@pytest.mark.unit
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_per_head_norms_of_strided_q_match_torch(variant: str, tokens: int) -> None:
    """Qwen3's q/k norms: one norm per head over head_dim, on a view of the qkv output."""
    q, _ = _qk(tokens, heads=9, kv_heads=3, dim=64)
    weight = torch.randn(64)
    with torch.inference_mode():
        got = _kernels(variant).rms_norm(q, weight, 1e-6)
    assert got.shape == q.shape
    assert _relative(got, TORCH_KERNELS.rms_norm(q, weight, 1e-6)) < ROUNDING


@pytest.mark.unit
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_adds_and_normalizes_in_place(variant: str, tokens: int, width: int) -> None:
    x, residual, weight = torch.randn(tokens, width), torch.randn(tokens, width), torch.randn(width)
    want_normed, want_sum = TORCH_KERNELS.add_rms_norm(x, residual, weight, 1e-5)
    with torch.inference_mode():
        normed, summed = _kernels(variant).add_rms_norm(x, residual, weight, 1e-5)
    assert normed is x and summed is residual
    assert torch.equal(summed, want_sum)
    assert _relative(normed, want_normed) < ROUNDING


@pytest.mark.unit
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dim", [64, 24, 128])
def test_rotate_matches_torch_in_place(variant: str, tokens: int, dim: int) -> None:
    """24 is a Phi-3 partial rotary width (the model hands over the rotated channels only)."""
    rotary = RotaryEmbedding(dim, 512, 10000.0, None)
    rope = TORCH_KERNELS.rope(torch.randint(0, 512, (tokens,)), rotary)
    q, k = _qk(tokens, heads=9, kv_heads=3, dim=dim)
    want_q, want_k = TORCH_KERNELS.rotate(q, k, rope)
    with torch.inference_mode():
        got_q, got_k = _kernels(variant).rotate(q, k, rope)
    assert got_q is q and got_k is k
    assert _relative(got_q, want_q) < ROUNDING
    assert _relative(got_k, want_k) < ROUNDING


@pytest.mark.unit
def test_bfloat16_takes_the_torch_ops() -> None:
    x, weight = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    q, k = (t.to(torch.bfloat16) for t in _qk(3, heads=4, kv_heads=2, dim=32))
    rope = TORCH_KERNELS.rope(torch.arange(3), RotaryEmbedding(32, 16, 10000.0, None))
    kernels = _kernels("native")
    with torch.inference_mode():
        normed = kernels.rms_norm(x, weight, 1e-5)
        assert torch.equal(normed, TORCH_KERNELS.rms_norm(x, weight, 1e-5))
        rotated = zip(kernels.rotate(q, k, rope), TORCH_KERNELS.rotate(q, k, rope), strict=True)
        assert all(torch.equal(got, want) for got, want in rotated)


@pytest.mark.unit
def test_a_pass_that_records_gradients_takes_the_torch_ops() -> None:
    x, weight = torch.randn(2, 64), torch.nn.Parameter(torch.randn(64))
    normed = _kernels("native").rms_norm(x, weight, 1e-5)
    assert normed.grad_fn is not None


@pytest.mark.unit
def test_rows_that_are_not_dense_take_the_torch_ops() -> None:
    x, residual, weight = torch.randn(64, 5).t(), torch.randn(5, 64), torch.randn(64)
    want_normed, want_sum = TORCH_KERNELS.add_rms_norm(x, residual, weight, 1e-5)
    kernels = _kernels("native")
    with torch.inference_mode():
        normed = kernels.rms_norm(x, weight, 1e-5)
        added = kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(normed, TORCH_KERNELS.rms_norm(x, weight, 1e-5))
    assert torch.equal(added[0], want_normed) and torch.equal(added[1], want_sum)


@pytest.mark.unit
def test_shapes_that_do_not_fit_together_are_refused_before_anything_changes() -> None:
    q, k = _qk(2, heads=4, kv_heads=2, dim=32)
    before = (q.clone(), k.clone())
    rope = TORCH_KERNELS.rope(torch.arange(2), RotaryEmbedding(16, 8, 10000.0, None))
    kernels = _kernels("native")
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="do not match cos/sin"):
            kernels.rotate(q, k, rope)
        with pytest.raises(RuntimeError, match="weight of 32 values"):
            kernels.rms_norm(q, torch.randn(31), 1e-5)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.unit
def test_tensors_written_in_place_that_overlap_are_refused() -> None:
    x, weight = torch.randn(3, 64), torch.randn(64)
    kernels = _kernels("native")
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="single memory location"):
            kernels.add_rms_norm(x, x, weight, 1e-5)
        with pytest.raises(RuntimeError, match="single memory location"):
            kernels.add_rms_norm(torch.randn(64).expand(3, 64), x, weight, 1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_a_tiny_model_computes_the_same_logits_on_the_kernels(tmp_path: Path, name: str) -> None:
    save_tiny_model(tmp_path, MODEL_CASES[name])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1))
    want = dense_logits(model, ids)
    kernels = _kernels("native")
    model.use_kernels(kernels)
    assert any(getattr(m, "kernels", None) is kernels for m in model.modules())

    got = dense_logits(model, ids)

    assert want.abs().max() > 0.1, "logits too small to reveal a mismatch"
    assert (got - want).abs().max().item() <= LOGITS


def _driver_kernels(tmp_path: Path, dtype: torch.dtype) -> LayerKernels:
    """The one set of kernels every module of a tiny model uses once a torch driver has it."""
    save_tiny_model(tmp_path, TINY_CASES["llama-linear-rope-tied"])
    loaded = load_model(str(tmp_path), dtype, "cpu")
    TorchDriver(
        loaded.model,
        loaded.config,
        page_size=4,
        num_pages=8,
        max_batch_tokens=16,
        max_batch_requests=2,
        device="cpu",
        dtype=dtype,
        model_name="tiny",
    )
    (kernels,) = {m.kernels for m in loaded.model.modules() if hasattr(type(m), "kernels")}
    assert isinstance(kernels, LayerKernels)
    return kernels


@pytest.mark.unit
def test_the_torch_driver_runs_a_float32_cpu_model_on_the_kernels(tmp_path: Path) -> None:
    assert isinstance(_driver_kernels(tmp_path, torch.float32), CpuLayerKernels)


@pytest.mark.unit
def test_the_torch_driver_keeps_the_torch_ops_for_bfloat16(tmp_path: Path) -> None:
    assert _driver_kernels(tmp_path, torch.bfloat16) is TORCH_KERNELS


@pytest.mark.unit
def test_a_kernel_that_does_not_build_leaves_the_torch_ops_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(library: str, variant: str = "native") -> Any:
        raise KernelBuildError("no C++ compiler")

    monkeypatch.setattr(cpu_layers, "kernel_ops", refuse)
    assert cpu_layer_kernels() is TORCH_KERNELS
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler" in err
