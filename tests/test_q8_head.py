"""The output head and tied embeddings in Q8_0 blocks (int4 weights): the kernel against float32
on the dequantized table, the file's own table read as llama.cpp defines it, and a model whose
head and embeddings are replaced computing what its float form computes on that table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pie.drivers.gguf_blocks import Q8Blocks, gguf_blocks8, quantize_blocks8
from pie.drivers.kernels import q4_ops
from pie.drivers.loader import load_model
from pie.drivers.q8_head import Q8Embedding, Q8Linear, file_tables, quantize_head
from pie.drivers.quantize4 import gguf_source
from tests.dense_attention import dense_logits
from tests.kernel_variants import VARIANTS
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.test_int4_weights import ROUNDING
from tests.tiny_models import TINY_CASES, VOCAB, save_tiny_model

Q8_0 = GGMLQuantizationType.Q8_0


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm() / want.norm()).detach())


def _random_blocks(rows: int, inputs: int, seed: int) -> Q8Blocks:
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(-127, 128, (rows, inputs), dtype=torch.int8, generator=generator)
    scales = (torch.rand(rows, inputs // 32, 1, generator=generator) * 0.01).half()
    return Q8Blocks(packed, scales)


@pytest.mark.unit
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_kernel_variant_multiplies_and_looks_up_like_the_dequantized_table(
    variant: str,
) -> None:
    ops = q4_ops(variant)
    for rows, inputs in ((320, 64), (1000, 576), (7, 96)):
        blocks = _random_blocks(rows, inputs, seed=rows)
        weight = blocks.dequantize()
        assert torch.equal(ops.dequantize8(blocks.packed, blocks.scales), weight)
        ids = torch.tensor([rows - 1, 0, 3, 3])
        assert torch.equal(ops.rows8(blocks.packed, blocks.scales, ids), weight[ids])
        for tokens in (1, 3, 9, 64):
            x = torch.randn(tokens, inputs)
            got = ops.linear8(x, blocks.packed, blocks.scales)
            assert _relative(got, x @ weight.T) < ROUNDING, (rows, inputs, tokens)


@pytest.mark.unit
def test_an_id_outside_the_table_is_refused() -> None:
    blocks = _random_blocks(10, 64, seed=0)
    with pytest.raises(RuntimeError, match="id 10 is out of range"):
        q4_ops().rows8(blocks.packed, blocks.scales, torch.tensor([2, 10]))


@pytest.mark.unit
def test_q8_0_blocks_mean_what_llama_cpp_says_and_quantizing_here_matches_it() -> None:
    weights = np.random.default_rng(1).standard_normal((12, 96)).astype(np.float32)
    raw = quantize(weights, Q8_0)
    want = torch.from_numpy(np.asarray(dequantize(raw, Q8_0), dtype=np.float32))
    assert torch.equal(gguf_blocks8(raw).dequantize(), want)
    ours = quantize_blocks8(torch.from_numpy(weights))
    assert torch.equal(ours.dequantize(), want)


def _tied_case() -> str:
    return next(name for name, case in TINY_CASES.items() if "tied" in name)


@pytest.mark.unit
def test_a_tied_model_gets_one_table_for_its_head_and_embeddings(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, TINY_CASES[_tied_case()])
    q8 = load_model(str(tmp_path), torch.float32, "cpu").model
    same = load_model(str(tmp_path), torch.float32, "cpu").model
    assert quantize_head(q8) == 2
    head, embeddings = q8.get_submodule("lm_head"), q8.get_submodule("model.embed_tokens")
    assert isinstance(head, Q8Linear) and isinstance(embeddings, Q8Embedding)
    assert head.packed is embeddings.packed
    table = Q8Blocks(head.packed, head.scales).dequantize()
    with torch.no_grad():
        same.get_submodule("model.embed_tokens").weight.copy_(table)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    want, got = (dense_logits(m, ids) for m in (same, q8))
    assert _relative(got, want) < ROUNDING * 10


@pytest.mark.unit
def test_an_untied_model_gets_a_q8_head_and_keeps_its_embeddings(tmp_path: Path) -> None:
    name = next(name for name, case in TINY_CASES.items() if "tied" not in name)
    save_tiny_model(tmp_path, TINY_CASES[name])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    assert quantize_head(model) == 1
    assert isinstance(model.get_submodule("lm_head"), Q8Linear)
    assert isinstance(model.get_submodule("model.embed_tokens"), torch.nn.Embedding)


@pytest.mark.model
def test_the_real_models_head_is_the_files_q8_0_table(
    default_model_dir: Path,  # noqa: F811
) -> None:
    """The default GGUF stores token_embd as Q8_0, which the float32 model was dequantized from:
    the Q8_0 head and embeddings compute the same logits up to the order of additions."""
    fp32 = load_model(str(default_model_dir), torch.float32, "cpu").model
    q8 = load_model(str(default_model_dir), torch.float32, "cpu").model
    tables = file_tables(gguf_source(default_model_dir), q8)
    assert quantize_head(q8, tables) == 2
    table = Q8Blocks(q8.lm_head.packed, q8.lm_head.scales).dequantize()
    assert torch.equal(table, fp32.lm_head.weight.detach())
    ids = torch.randint(0, 49152, (16,), generator=torch.Generator().manual_seed(0))
    want, got = (dense_logits(m, ids) for m in (fp32, q8))
    assert _relative(got, want) < 1e-5
