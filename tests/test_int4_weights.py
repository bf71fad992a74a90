"""Linear weights kept in 4-bit blocks on the CPU (`[model] weights = "int4"`): the compiled
kernel (each instruction-set variant) against float32 on the dequantized weight, the blocks
against llama.cpp's own format, the layers against their float forms, the kernel's build and its
errors, and the real default model served from its GGUF file's own Q4_1 blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dense_attention import dense_logits
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from torch import nn

from pie.actors.generate import generate, prompt_ids
from pie.config import with_overrides
from pie.drivers import kernels
from pie.drivers.factory import build_torch_driver
from pie.drivers.gguf_blocks import Q4_KINDS, Q4Blocks, block_tensors, gguf_blocks, quantize_blocks
from pie.drivers.kernels import KernelBuildError, build_q4, q4_ops
from pie.drivers.loader import load_model
from pie.drivers.models.layers import FusedLinear
from pie.drivers.quantize4 import Int4FusedLinear, Int4Linear, quantize_int4
from pie.engine import open_engine
from pie.events.sampling import Argmax
from tests.kernel_variants import VARIANTS
from tests.model_fixtures import default_model_dir, real  # noqa: F401  (fixtures)
from tests.tiny_models import TINY_CASES, VOCAB, save_tiny_model

ROUNDING = 1e-5
"""Relative error (Frobenius norm) allowed where only the order of float32 additions differs."""
INT4_TOLERANCE = 0.12
"""One layer quantized here (min/max per group of 32) against float32 on random weights: a step
is a fifteenth of the group's range, so about 8% relative error; 12% leaves room."""

SHAPES = [(96, 64), (960, 576), (576, 1536), (33, 32), (7, 96)]
Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm() / want.norm()).detach())


def _random_blocks(rows: int, inputs: int, seed: int) -> Q4Blocks:
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, inputs // 2), dtype=torch.uint8, generator=generator)
    scales = (torch.randn(rows, inputs // 32, 2, generator=generator) * 0.05).half()
    return Q4Blocks(packed, scales)


@pytest.mark.unit
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_kernel_variant_multiplies_like_float32_on_the_dequantized_weight(
    variant: str,
) -> None:
    ops = q4_ops(variant)
    if variant != "native":
        assert ops.isa() == variant
    for rows, inputs in SHAPES:
        blocks = _random_blocks(rows, inputs, seed=rows + inputs)
        weight = blocks.dequantize()
        assert torch.equal(ops.dequantize(blocks.packed, blocks.scales), weight)
        for tokens in (1, 2, 5, 16, 77):
            x = torch.randn(tokens, inputs)
            got = ops.linear(x, blocks.packed, blocks.scales)
            assert _relative(got, x @ weight.T) < ROUNDING, (rows, inputs, tokens)


@pytest.mark.unit
def test_a_weight_larger_than_one_scratch_chunk_is_multiplied_in_pieces() -> None:
    """Prefill dequantizes W 8 MB at a time: 600 rows of 4096 take two chunks."""
    blocks = _random_blocks(600, 4096, seed=3)
    x = torch.randn(48, 4096)
    got = q4_ops().linear(x, blocks.packed, blocks.scales)
    assert _relative(got, x @ blocks.dequantize().T) < ROUNDING


@pytest.mark.unit
@pytest.mark.parametrize("kind", [Q4_0, Q4_1])
def test_a_gguf_files_blocks_mean_what_llama_cpp_says_they_mean(
    kind: GGMLQuantizationType,
) -> None:
    weights = np.random.default_rng(1).standard_normal((12, 96)).astype(np.float32)
    raw = quantize(weights, kind)
    blocks = gguf_blocks(kind, raw)
    want = torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32))
    assert torch.equal(blocks.dequantize(), want)


@pytest.mark.unit
def test_block_tensors_are_found_from_the_gguf_index_as_gguf_reads_them(tmp_path: Path) -> None:
    """Our index walk skips every kind of metadata value (strings, arrays of strings and of
    numbers, scalars) and yields the Q4 and Q8_0 tensors' bytes, one row per output row."""
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_array("some.ints", [1, 2, 3])
    writer.add_string("general.name", "tiny")
    writer.add_float32("some.float", 1.5)
    writer.add_tensor("plain.weight", rng.standard_normal((4, 64)).astype(np.float32))
    tensors = (
        ("zero.weight", Q4_0, (6, 64)),
        ("one.weight", Q4_1, (3, 2, 96)),
        ("eight.weight", Q8_0, (5, 64)),
    )
    for name, kind, shape in tensors:
        raw = quantize(rng.standard_normal(shape).astype(np.float32), kind)
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs = {t.name: t for t in GGUFReader(path).tensors if t.tensor_type in (Q4_0, Q4_1, Q8_0)}
    ours = {name: (kind, raw) for name, kind, raw in block_tensors(path)}
    assert ours.keys() == theirs.keys() == {"zero.weight", "one.weight", "eight.weight"}
    assert [name for name, _, _ in block_tensors(path, Q4_KINDS)] == ["zero.weight", "one.weight"]
    for name, (kind, raw) in ours.items():
        assert kind == theirs[name].tensor_type
        assert np.array_equal(raw, np.asarray(theirs[name].data).reshape(raw.shape))
    assert ours["one.weight"][1].shape == (6, 60)


@pytest.mark.unit
def test_quantizing_keeps_every_weight_within_half_a_step() -> None:
    torch.manual_seed(5)
    weight = torch.randn(64, 128)
    weight[3, :32] = 0.25  # a group with no range comes back exact
    blocks = quantize_blocks(weight)
    error = (blocks.dequantize() - weight).abs().reshape(64, 4, 32)
    step = blocks.scales[..., 0].float()
    assert (error <= step[..., None] * 0.5 + 2e-3).all()
    assert torch.equal(blocks.dequantize()[3, :32], weight[3, :32])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("rows", "inputs", "outputs", "bias"), [(1, 64, 96, True), (5, 576, 960, False)]
)
def test_an_int4_layer_is_its_float_form_on_the_weights_it_holds(
    rows: int, inputs: int, outputs: int, bias: bool
) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(inputs, outputs, bias=bias)
    quantized = Int4Linear(layer)
    assert quantized.packed.dtype == torch.uint8
    x = torch.randn(rows, inputs)
    assert _relative(quantized(x), layer(x)) < INT4_TOLERANCE
    with torch.no_grad():
        layer.weight.copy_(Q4Blocks(quantized.packed, quantized.scales).dequantize())
    assert _relative(quantized(x), layer(x)) < ROUNDING
    assert quantized(x.reshape(1, rows, inputs)).shape == (1, rows, outputs)


@pytest.mark.unit
def test_a_fused_projection_splits_the_same_way_in_int4() -> None:
    torch.manual_seed(2)
    fused = FusedLinear(64, [("q", 32), ("k", 32), ("v", 32)], bias=True)
    x = torch.randn(3, 64)
    parts = Int4FusedLinear(fused).forward_split(x)
    assert [p.shape[-1] for p in parts] == [32, 32, 32]
    for got, want in zip(parts, fused.forward_split(x), strict=True):
        assert _relative(got, want) < INT4_TOLERANCE


@pytest.mark.unit
def test_a_layer_whose_inputs_do_not_fill_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear(nn.Linear(48, 8))


@pytest.mark.unit
@pytest.mark.parametrize("name", list(TINY_CASES))
def test_every_architecture_in_int4_computes_its_float_form_on_the_blocks_it_holds(
    tmp_path: Path, name: str
) -> None:
    """Every decoder linear layer (fused ones by shard, biases kept) is replaced, and the model
    then computes what the float model computes with the dequantized blocks as its weights."""
    save_tiny_model(tmp_path, TINY_CASES[name])
    int4 = load_model(str(tmp_path), torch.float32, "cpu").model
    linears = sum(isinstance(m, nn.Linear) for m in int4.modules())
    assert quantize_int4(int4, tmp_path) == linears - 1
    left = [n for n, m in int4.named_modules() if isinstance(m, nn.Linear)]
    assert left == ["lm_head"]
    same = load_model(str(tmp_path), torch.float32, "cpu").model
    with torch.no_grad():
        for path, layer in int4.named_modules():
            if isinstance(layer, Int4Linear):
                blocks = Q4Blocks(layer.packed, layer.scales)
                same.get_submodule(path).weight.copy_(blocks.dequantize())
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    want, got = (dense_logits(m, ids) for m in (same, int4))
    assert _relative(got, want) < ROUNDING * 10


@pytest.mark.unit
def test_int4_weights_are_refused_off_the_cpu() -> None:
    from pie.drivers.factory import _weights
    from pie.drivers.select import DriverChoice

    cuda = DriverChoice(driver="torch", device="cuda", dtype=torch.bfloat16, reason="")
    with pytest.raises(ValueError, match="CPU only"):
        _weights(None, "int4", cuda)


@pytest.mark.unit
def test_a_missing_compiler_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(KernelBuildError, match="compiler '/nonexistent/g[+][+]' was not found"):
        build_q4("native", tmp_path)


@pytest.mark.unit
def test_a_second_build_of_a_loaded_kernel_is_refused_not_a_crash(tmp_path: Path) -> None:
    """torch aborts a process that registers a loaded namespace again (a kernel whose source
    changed while the process ran): that build is refused with an error instead."""
    q4_ops()
    with pytest.raises(KernelBuildError, match="restart the process"):
        kernels.build_kernels("q4", "native", tmp_path)
    assert q4_ops().isa()


@pytest.mark.unit
def test_a_missing_ninja_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = kernels.shutil.which
    monkeypatch.setattr(
        kernels.shutil, "which", lambda name: None if name == "ninja" else real_which(name)
    )
    monkeypatch.setitem(sys.modules, "ninja", None)
    with pytest.raises(KernelBuildError, match="needs ninja"):
        build_q4("native", tmp_path)


@pytest.mark.unit
def test_a_second_process_loads_the_built_kernel_without_building() -> None:
    q4_ops()
    script = (
        "import time, torch\n"
        "from pie.drivers.kernels import q4_ops\n"
        "started = time.perf_counter(); q4_ops().isa()\n"
        "print(time.perf_counter() - started)\n"
    )
    env = {**os.environ, "CXX": "/nonexistent/g++"}  # a build would fail
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    assert float(out.stdout) < 1.0


@pytest.mark.integration
def test_two_first_starts_at_once_build_the_kernel_once(tmp_path: Path) -> None:
    script = "from pie.drivers.kernels import q4_ops; print(q4_ops('portable').isa())"
    env = {**os.environ, "PIE_CACHE_DIR": str(tmp_path)}
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300) for process in starts]
    assert [process.returncode for process in starts] == [0, 0]
    assert [out.decode().strip() for out, _ in outputs] == ["portable", "portable"]
    assert sum(b"compiling" in err for _, err in outputs) == 1


@pytest.mark.model
def test_the_real_model_from_its_own_q4_1_blocks_computes_what_float32_does(
    default_model_dir: Path,  # noqa: F811
) -> None:
    """The int4 layers hold the GGUF file's blocks, which the float32 model was dequantized from:
    over 64 tokens (the prefill path) and 8 (the register kernel) the logits differ only by the
    order of float32 additions."""
    fp32 = load_model(str(default_model_dir), torch.float32, "cpu").model
    int4 = load_model(str(default_model_dir), torch.float32, "cpu").model
    assert quantize_int4(int4, default_model_dir) == 30 * 4
    ids = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(0))
    for tokens in (ids, ids[:8]):
        want, got = (dense_logits(m, tokens) for m in (fp32, int4))
        assert _relative(got, want) < 1e-3


@pytest.mark.model
async def test_the_engine_serves_the_int4_model_with_float32s_greedy_tokens(
    real: Any,  # noqa: F811
) -> None:
    config, driver, tokenizer = real
    prompt = prompt_ids(tokenizer, "Name three colours of the rainbow.")
    tokens = []
    int4_driver, _ = build_torch_driver(with_overrides(config, model={"weights": "int4"}))
    for engine_driver in (driver, int4_driver):
        async with open_engine(config, driver=engine_driver, tokenizer=tokenizer) as engine:
            async with engine.requester() as req:
                out = await generate(req, prompt, max_tokens=16, sampler=Argmax())
        tokens.append(list(out.tokens))
    assert len(tokens[0]) == 16
    assert tokens[1] == tokens[0]
