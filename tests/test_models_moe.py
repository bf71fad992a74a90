"""Mixture-of-experts architectures (Qwen3-MoE, Mixtral) against transformers on tiny random
checkpoints: logits through the dense reference and through the torch driver, the batched
expert dispatch against a per-token reference, whole-engine greedy generation, and int8."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from dense_attention import dense_logits
from safetensors.torch import load_file, save_file
from torch import nn

from pie.config import EngineConfig, with_overrides
from pie.drivers.batch import ForwardBatch
from pie.drivers.loader import load_model
from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.models import CausalLM, moe
from pie.drivers.models.layers import GatedMLP
from pie.drivers.models.moe import ExpertProjection, Router, SparseMoeBlock
from pie.drivers.quantize import Int8Linear, quantize_int8
from pie.drivers.torch_driver import TorchDriver
from pie.events.forward import ForwardRequest
from pie.events.sampling import LogitsOutput, RawLogits, SamplingSlot
from tests.engine_greedy import assert_matches, engine_greedy, hf_greedy
from tests.tiny_models import TINY_SHAPE, TINY_TOLERANCE, VOCAB, reference_logits, save_tiny_model

EXPERTS = dict(num_experts_per_tok=2)
MOE_CASES: dict[str, dict[str, Any]] = {
    "qwen3_moe-renormalised-top2": dict(
        model_type="qwen3_moe",
        num_experts=8,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        **EXPERTS,
    ),
    "qwen3_moe-dense-and-sparse-layers": dict(
        model_type="qwen3_moe",
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        mlp_only_layers=[0],
        decoder_sparse_step=2,
        head_dim=32,
    ),
    "mixtral-sliding-window": dict(
        model_type="mixtral",
        num_local_experts=8,
        intermediate_size=32,
        sliding_window=16,
        **EXPERTS,
    ),
}
SEQUENCE_LENGTH = 48


def _ids(n: int = SEQUENCE_LENGTH, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.unit
@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_model_matches_transformers(tmp_path: Path, name: str) -> None:
    reference = save_tiny_model(tmp_path, MOE_CASES[name])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    ids = _ids()

    ours, theirs = dense_logits(model, ids), reference_logits(reference, ids)

    assert theirs.abs().max() > 0.1, "logits too small to reveal a mismatch"
    assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE


@pytest.mark.unit
def test_qwen3_moe_puts_dense_mlps_on_mlp_only_and_off_step_layers(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, MOE_CASES["qwen3_moe-dense-and-sparse-layers"])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    kinds = [type(layer.mlp) for layer in model.get_submodule("model.layers")]
    # Layer 0 is listed in mlp_only_layers; with decoder_sparse_step 2, layers 1 and 3 are sparse.
    assert kinds == [GatedMLP, SparseMoeBlock, GatedMLP, SparseMoeBlock]


@pytest.mark.unit
def test_mixtral_sliding_window_reaches_the_attention(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, MOE_CASES["mixtral-sliding-window"])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    assert {layer.sliding_window for layer in model.attention_layers()} == {16}
    windowed, full = dense_logits(model, _ids()), dense_logits(model, _ids(), ())
    assert (windowed[:16] - full[:16]).abs().max() <= 1e-6
    assert (windowed[16:] - full[16:]).abs().max() > 0.01


def _driver(model: CausalLM, name: str) -> TorchDriver:
    return TorchDriver(
        model,
        model.config,
        page_size=4,
        num_pages=32,
        max_batch_tokens=256,
        max_batch_requests=8,
        device="cpu",
        dtype=torch.float32,
        model_name=name,
        seed=0,
    )


def _request(context: int, ids: Sequence[int], done: int, pages: Sequence[int]) -> ForwardRequest:
    """The next tokens of a context after `done` of them, reading logits at every one."""
    return ForwardRequest(
        corr=0,
        requester="test",
        context=context,
        tokens=tuple(ids),
        positions=tuple(range(done, done + len(ids))),
        kv_start=done,
        pages=tuple(pages),
        slots=tuple(SamplingSlot(index=i, op=RawLogits()) for i in range(len(ids))),
    )


def _logits(outputs: Sequence[Any]) -> torch.Tensor:
    assert all(isinstance(out, LogitsOutput) for out in outputs)
    return torch.tensor([out.values for out in outputs])


@pytest.mark.unit
@pytest.mark.parametrize("name", list(MOE_CASES))
def test_torch_driver_gives_transformers_logits_for_contexts_sharing_passes(
    tmp_path: Path, name: str
) -> None:
    """Context a's prompt arrives in two passes, the first shared with all of context b."""
    reference = save_tiny_model(tmp_path, MOE_CASES[name])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    a, b = _ids().tolist(), _ids(20, seed=2).tolist()
    pages_a, pages_b = range(0, 12), range(12, 17)
    driver = _driver(model, name)

    first = driver.forward(
        ForwardBatch.from_requests([_request(0, a[:30], 0, pages_a), _request(1, b, 0, pages_b)])
    )
    second = driver.forward(ForwardBatch.from_requests([_request(0, a[30:], 30, pages_a)]))

    ours_a = _logits([*first[:30], *second])
    ours_b = _logits(first[30:])
    theirs_a = reference_logits(reference, torch.tensor(a))
    theirs_b = reference_logits(reference, torch.tensor(b))
    assert (ours_a - theirs_a).abs().max().item() <= TINY_TOLERANCE
    assert (ours_b - theirs_b).abs().max().item() <= TINY_TOLERANCE


def _per_token_reference(block: SparseMoeBlock, hidden: torch.Tensor) -> torch.Tensor:
    """Each token alone, in float64: softmax over all experts, its top k, their MLPs summed."""
    router = block.gate.weight.double()
    gate_up = block.experts.gate_up_proj.weight.double()
    down = block.experts.down_proj.weight.double()
    rows = []
    for x in hidden.double():
        probs = (router @ x).softmax(-1)
        weights, chosen = probs.topk(block.gate.top_k)
        if block.gate.normalize:
            weights = weights / weights.sum()
        out = torch.zeros_like(x)
        for weight, expert in zip(weights, chosen.tolist(), strict=True):
            gate, up = (gate_up[expert] @ x).chunk(2)
            out += weight * (down[expert] @ (torch.nn.functional.silu(gate) * up))
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.unit
@pytest.mark.parametrize("tokens", [1, 37], ids=["decode-most-experts-idle", "prefill"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-gemm", "per-expert"])
def test_batched_routing_equals_each_token_routed_alone(
    tokens: int, normalize: bool, grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(moe, "grouped_mm_runs", lambda _: grouped)
    torch.manual_seed(3)
    block = SparseMoeBlock(64, 32, num_experts=8, top_k=3, normalize=normalize)
    for param in block.parameters():
        nn.init.normal_(param, std=0.2)
    hidden = torch.randn(tokens, 64)

    with torch.inference_mode():
        ours = block(hidden)

    want = _per_token_reference(block, hidden)
    assert ours.dtype == torch.float32
    assert want.abs().max() > 0.1
    assert (ours.double() - want).abs().max().item() <= 1e-5


@pytest.mark.unit
def test_int8_weights_quantize_attention_and_dense_mlps_and_keep_experts_float(
    tmp_path: Path,
) -> None:
    reference = save_tiny_model(tmp_path, MOE_CASES["qwen3_moe-dense-and-sparse-layers"])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    calibration = _ids(64, seed=2).tolist()

    # Per layer: fused qkv and o_proj; the two dense layers add gate_up and down.
    assert quantize_int8(model, calibration) == 4 * 2 + 2 * 2

    left = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert left == ["lm_head"]
    assert isinstance(model.get_submodule("model.layers.0.mlp.down_proj"), Int8Linear)
    assert isinstance(model.get_submodule("model.layers.1.mlp.gate"), Router)
    experts = [m for m in model.modules() if isinstance(m, ExpertProjection)]
    assert experts and all(m.weight.dtype == torch.float32 for m in experts)
    ids = _ids()
    ours, theirs = dense_logits(model, ids), reference_logits(reference, ids)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.05
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.85


def _unshard(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, its files removed (the test writes them back edited)."""
    merged: dict[str, torch.Tensor] = {}
    for shard in folder.glob("model-*.safetensors"):
        merged |= load_file(shard)
        shard.unlink()
    (folder / "model.safetensors.index.json").unlink()
    return merged


@pytest.mark.unit
def test_a_missing_expert_weight_is_named_by_its_stacked_slice(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, MOE_CASES["mixtral-sliding-window"])
    merged = _unshard(tmp_path)
    del merged["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(merged, tmp_path / "model.safetensors")

    with pytest.raises(ValueError) as error:
        load_model(str(tmp_path), torch.float32, "cpu")

    # w3 is expert 5's up projection: the second of its two parts, shard 5 * 2 + 1.
    assert "missing ['model.layers.1.mlp.experts.gate_up_proj.weight[11]']" in str(error.value)


@pytest.mark.unit
def test_experts_stored_stacked_load_like_experts_stored_one_by_one(tmp_path: Path) -> None:
    """transformers holds experts as [E, 2I, H] gate_up and [E, H, I] down tensors in memory;
    a checkpoint written in that layout loads too."""
    reference = save_tiny_model(tmp_path, MOE_CASES["qwen3_moe-renormalised-top2"])
    tensors = _unshard(tmp_path)
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        pieces = [
            [tensors.pop(f"{prefix}.{e}.{name}.weight") for name in ("gate_proj", "up_proj")]
            for e in range(8)
        ]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(p) for p in pieces])
        downs = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(8)]
        tensors[f"{prefix}.down_proj"] = torch.stack(downs)
    save_file(tensors, tmp_path / "model.safetensors")

    model = load_model(str(tmp_path), torch.float32, "cpu").model

    ids = _ids()
    ours, theirs = dense_logits(model, ids), reference_logits(reference, ids)
    assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE


@pytest.mark.unit
def test_configs_read_expert_counts_under_either_name_and_fill_mixtral_defaults() -> None:
    shape = dict(TINY_SHAPE, num_experts_per_tok=2, moe_intermediate_size=32)
    for key in ("num_experts", "num_local_experts"):
        config = model_config_from_hf({**shape, "model_type": "qwen3_moe", key: 4})
        assert moe.num_experts(config.raw, 128) == 4
    mixtral = model_config_from_hf({**TINY_SHAPE, "model_type": "mixtral"})
    assert (mixtral.rms_norm_eps, mixtral.rope_theta) == (1e-5, 1e6)
    assert moe.num_experts(mixtral.raw, 8) == 8


@pytest.mark.unit
def test_qwen3_moe_refuses_sliding_windows() -> None:
    raw = {**TINY_SHAPE, "model_type": "qwen3_moe", "use_sliding_window": True}
    with pytest.raises(ValueError, match="sliding-window layers on 'qwen3_moe'"):
        model_config_from_hf(raw)


PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [250, 11, 64, 64, 9, 30, 31], [8]]


@pytest.mark.integration
@pytest.mark.parametrize("name", ["qwen3_moe-dense-and-sparse-layers", "mixtral-sliding-window"])
async def test_engine_greedy_equals_transformers_alone_and_batched(
    tmp_path: Path, name: str
) -> None:
    reference = save_tiny_model(tmp_path, MOE_CASES[name])
    config = with_overrides(
        EngineConfig(),
        model={"path": str(tmp_path), "dtype": "float32", "device": "cpu"},
        kv={"num_pages": 256, "page_size": 4},
    )
    expected = [hf_greedy(reference, ids, 20) for ids in PROMPTS]
    assert_matches(await engine_greedy(config, PROMPTS, 20), expected)
