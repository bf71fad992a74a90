"""Mistral, Phi-3 and OLMo 2 against transformers on tiny random checkpoints: logits through the
dense reference and through the torch driver's paged attention, whole-engine greedy generation
alone and batched, KV pages released as Mistral's window slides, int8 weights, and the config
checks that refuse what is not implemented."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from dense_attention import DenseCausalAttention, dense_logits
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache

import tests.paged_reference as paged_reference
from pie.config import EngineConfig, with_overrides
from pie.drivers.attention import PagedAttention
from pie.drivers.batch import ForwardBatch
from pie.drivers.factory import build_torch_driver
from pie.drivers.fused_layers import layer_kernels_for
from pie.drivers.kvcache import KvCacheShape, PagedKvCache
from pie.drivers.loader import load_model
from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.models import CausalLM, build_model
from pie.drivers.quantize import quantize_int8
from pie.engine import Engine, open_engine
from pie.events.forward import ForwardRequest
from pie.events.sampling import Argmax, SamplingSlot, TokenOutput
from tests.engine_greedy import assert_matches, engine_greedy, hf_greedy
from tests.tiny_models import TINY_SHAPE, TINY_TOLERANCE, VOCAB, reference_logits, save_tiny_model

PAGE = 4
WINDOW = 8
SHORT, LONG = [1.0 + 0.1 * i for i in range(6)], [1.0 + 2.0 * i for i in range(6)]
CASES: dict[str, dict[str, Any]] = {
    "mistral-window-8": dict(model_type="mistral", sliding_window=WINDOW),
    "phi3-half-rotary-window-12": dict(
        model_type="phi3", pad_token_id=0, partial_rotary_factor=0.5, sliding_window=12
    ),
    # 256 positions over an original 16: the long factors and an attention factor of sqrt(2).
    "phi3-longrope": dict(
        model_type="phi3",
        pad_token_id=0,
        original_max_position_embeddings=16,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            partial_rotary_factor=0.75,
            short_factor=SHORT,
            long_factor=LONG,
        ),
    ),
    # No positions past the original 32: the short factors.
    "phi3-longrope-short": dict(
        model_type="phi3",
        pad_token_id=0,
        max_position_embeddings=32,
        original_max_position_embeddings=32,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            partial_rotary_factor=0.75,
            short_factor=SHORT,
            long_factor=LONG,
        ),
    ),
    "olmo2-post-norm": dict(model_type="olmo2", eos_token_id=None),
}
ENGINE_CASES = [
    "mistral-window-8",
    "phi3-half-rotary-window-12",
    "phi3-longrope",
    "olmo2-post-norm",
]
# Longer than every window and than phi3-longrope's original 16 positions, where transformers
# starts on the long factors too.
PROMPTS = [list(range(5, 22)), list(range(300, 282, -1)), [7, 99, 42] * 7, list(range(40, 65))]


def _ids(name: str) -> torch.Tensor:
    length = min(48, CASES[name].get("max_position_embeddings", 256))
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(1))


def _paged_logits(model: CausalLM, ids: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """The sequence fed in passes ending at `ends`, its KV on scattered pages of a cache."""
    c = model.config
    shape = KvCacheShape(
        num_layers=c.num_layers,
        page_size=PAGE,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=torch.float32,
    )
    cache = PagedKvCache(shape, 32, "cpu")
    pages = random.Random(0).sample(range(32), -(-ids.numel() // PAGE))
    logits, start = [], 0
    for end in ends:
        request = ForwardRequest(
            corr=0,
            requester="test",
            context=0,
            tokens=tuple(ids[start:end].tolist()),
            positions=tuple(range(start, end)),
            kv_start=start,
            pages=tuple(pages[: -(-end // PAGE)]),
        )
        attention = PagedAttention(
            ForwardBatch.from_requests([request]), cache, model.attention_layers()
        )
        positions = torch.tensor(model.rope_positions(range(start, end), [0, end - start]))
        with torch.inference_mode():
            hidden = model(ids[start:end], positions, attention)
            logits.append(model.compute_logits(hidden))
        start = end
    return torch.cat(logits)


def _reference_in_passes(reference: Any, ids: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """transformers' logits with the sequence fed in passes ending at `ends` over its KV cache,
    as the engine feeds it (LongRoPE chooses its factors per pass)."""
    cache, logits, start = DynamicCache(), [], 0
    with torch.inference_mode():
        for end in ends:
            out = reference(ids[None, start:end], past_key_values=cache, use_cache=True)
            logits.append(out.logits[0].float())
            start = end
    return torch.cat(logits)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_through_dense_attention(tmp_path: Path, name: str) -> None:
    reference = save_tiny_model(tmp_path, CASES[name])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    ids = _ids(name)

    ours, theirs = dense_logits(model, ids), reference_logits(reference, ids)

    assert theirs.abs().max() > 0.1, "logits too small to reveal a mismatch"
    assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE


@pytest.mark.unit
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_through_paged_attention(tmp_path: Path, name: str) -> None:
    reference = save_tiny_model(tmp_path, CASES[name])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    ids = _ids(name)
    ends = [13, 14, 22, ids.numel()]  # a prefill, a decode, and passes across page boundaries
    ours = _paged_logits(model, ids, ends)

    # phi3-longrope's first passes end before its original 16 positions: short factors there.
    if name == "phi3-longrope":
        theirs = _reference_in_passes(reference, ids, ends)
    else:
        theirs = reference_logits(reference, ids)
    assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE


@pytest.mark.unit
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_on_the_fused_layer_kernels(tmp_path: Path, name: str) -> None:
    """The CUDA driver's norm and rope kernels (their CPU stand-in here) rotate a partial
    rotary width too."""
    reference = save_tiny_model(tmp_path, CASES[name])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    model.use_kernels(layer_kernels_for(paged_reference))
    ids = _ids(name)

    ours = dense_logits(model, ids)

    assert (ours - reference_logits(reference, ids)).abs().max().item() <= TINY_TOLERANCE


@pytest.mark.unit
def test_the_mistral_window_changes_what_the_prompt_sees(tmp_path: Path) -> None:
    """The comparisons above use prompts longer than the window: without it, logits differ."""
    reference = save_tiny_model(tmp_path, CASES["mistral-window-8"])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    ids = _ids("mistral-window-8")
    unwindowed = dense_logits(model, ids, ())
    assert (unwindowed - reference_logits(reference, ids)).abs().max().item() > 0.1


def _engine_config(folder: Path, **model: Any) -> EngineConfig:
    return with_overrides(
        EngineConfig(),
        model={"path": str(folder), "dtype": "float32", "device": "cpu", **model},
        kv={"num_pages": 256, "page_size": PAGE},
    )


@pytest.mark.integration
@pytest.mark.parametrize("name", ENGINE_CASES)
async def test_engine_greedy_equals_transformers(tmp_path: Path, name: str) -> None:
    reference = save_tiny_model(tmp_path, CASES[name])
    config = _engine_config(tmp_path)
    expected = [hf_greedy(reference, ids, 20) for ids in PROMPTS]
    assert_matches(await engine_greedy(config, PROMPTS, 20), expected)


@pytest.mark.integration
async def test_longrope_reads_its_short_factors_inside_the_original_length(
    tmp_path: Path,
) -> None:
    """Contexts inside phi3-longrope's original 16 positions run on the short factors, as in
    transformers (the model holds 256 positions, so the long table is there too, and reading
    it would change the logits)."""
    reference = save_tiny_model(tmp_path, CASES["phi3-longrope"])
    prompts = [list(range(5, 13)), [7, 99, 42, 3, 11, 1, 2, 3]]
    config = _engine_config(tmp_path)
    # 8 prompt tokens and 9 generated ones: the last pass is at position 15.
    expected = [hf_greedy(reference, ids, 9) for ids in prompts]
    assert_matches(await engine_greedy(config, prompts, 9), expected)
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    ids = torch.tensor(prompts[0])
    attention = DenseCausalAttention(model.attention_layers())
    with torch.inference_mode():
        long_table = model.compute_logits(model(ids, torch.arange(8) + 16, attention))
    theirs = reference_logits(reference, ids)
    assert (dense_logits(model, ids) - theirs).abs().max().item() <= TINY_TOLERANCE
    assert (long_table - theirs).abs().max().item() > 1e-2


@pytest.mark.unit
def test_a_request_reaching_past_the_original_length_reads_the_long_table(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, CASES["phi3-longrope"])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    # Three requests: a decode inside the original 16 positions, a prefill that ends past it
    # (all its tokens move to the long table, as transformers' whole-pass choice does), and a
    # decode past it.
    positions = [9, 13, 14, 15, 16, 40]
    assert model.rope_positions(positions, [0, 1, 5, 6]) == [9, 29, 30, 31, 32, 56]
    assert model.rope_positions([3, 4], [0, 2]) == [3, 4]


async def _decode_pass_by_pass(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, one pass each, with no pages reserved ahead: each pass allocates what
    it writes, so the pages a context holds are what the window leaves it."""
    tokens: list[int] = []
    async with engine.requester() as req:
        context = await req.create_context()
        feed = prompt
        for _ in range(n):
            slot = SamplingSlot(index=len(feed) - 1, op=Argmax())
            (out,) = await req.forward(context, feed, (slot,))
            assert isinstance(out, TokenOutput)
            tokens.append(out.token)
            feed = [out.token]
        await req.destroy(context)
    return tokens


async def _decode_watching_pages(
    engine: Engine, prompts: list[list[int]], n: int
) -> tuple[list[list[int]], int]:
    """Each prompt's tokens, all decoding at once, and the most KV pages in use meanwhile."""
    total = engine.statistics().kv.pages_total
    lowest = engine.statistics().kv.pages_free
    out: dict[int, list[int]] = {}

    async def watch() -> None:
        nonlocal lowest
        while True:
            lowest = min(lowest, engine.statistics().kv.pages_free)
            await trio.sleep(0.001)

    async def run(i: int) -> None:
        out[i] = await _decode_pass_by_pass(engine, prompts[i], n)

    with trio.fail_after(120):
        async with trio.open_nursery() as watching:
            watching.start_soon(watch)
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(run, i)
            watching.cancel_scope.cancel()
    return [out[i] for i in range(len(prompts))], total - lowest


@pytest.mark.integration
async def test_a_long_mistral_generation_holds_a_bounded_number_of_pages(tmp_path: Path) -> None:
    """60 tokens past a 5-token prompt fill 17 pages of 4; a window of 8 slots needs only the
    page being written and the 2 before it (one more while a page turns), and the tokens still
    equal transformers' with the same window, alone and 8 at once."""
    reference = save_tiny_model(tmp_path, CASES["mistral-window-8"])
    config = _engine_config(tmp_path)
    driver, tokenizer = await trio.to_thread.run_sync(build_torch_driver, config)
    prompts = [[5 + i, 17, 42, 99, 7] for i in range(4)]
    expected = [hf_greedy(reference, ids, 60, "cpu") for ids in prompts]
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        alone, alone_peak = await _decode_watching_pages(engine, prompts[:1], 60)
        released_alone = engine.statistics().kv.pages_released
        together, together_peak = await _decode_watching_pages(engine, prompts * 2, 60)
        stats = engine.statistics().kv
    assert driver.info.sliding_window == WINDOW
    assert alone == expected[:1] and together == expected * 2
    assert alone_peak <= 3 + 1 and together_peak <= 8 * (3 + 1)
    assert released_alone >= 64 // PAGE - 3
    assert stats.pages_released - released_alone >= 8 * (64 // PAGE - 3)
    assert stats.pages_free == stats.pages_total


@pytest.mark.unit
@pytest.mark.parametrize("name", list(CASES))
def test_int8_weights_stay_near_the_float32_reference(tmp_path: Path, name: str) -> None:
    reference = save_tiny_model(tmp_path, CASES[name])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    calibration = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2))

    quantize_int8(model, calibration.tolist())

    assert [n for n, m in model.named_modules() if isinstance(m, nn.Linear)] == ["lm_head"]
    ids = _ids(name)
    ours, theirs = dense_logits(model, ids), reference_logits(reference, ids)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.05
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.85


@pytest.mark.unit
def test_a_phi3_checkpoint_without_its_fused_qkv_names_what_is_missing(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, CASES["phi3-half-rotary-window-12"])
    for shard in tmp_path.glob("model-*.safetensors"):
        weights = load_file(shard)
        weights.pop("model.layers.1.self_attn.qkv_proj.weight", None)
        save_file(weights, shard, metadata={"format": "pt"})

    with pytest.raises(ValueError) as error:
        load_model(str(tmp_path), torch.float32, "cpu")

    assert "model.layers.1.self_attn.qkv_proj.weight[q]" in str(error.value)
    assert "model.layers.0.self_attn.qkv_proj" not in str(error.value)


def _config(**raw: Any) -> dict[str, Any]:
    return {**TINY_SHAPE, **raw}


@pytest.mark.unit
@pytest.mark.parametrize("window", [None, 256, 4096])
def test_a_null_or_all_covering_window_is_full_attention(window: int | None) -> None:
    config = model_config_from_hf(_config(model_type="mistral", sliding_window=window))
    model = build_model(config, torch.float32, "meta")
    assert {layer.sliding_window for layer in model.attention_layers()} == {None}


@pytest.mark.unit
def test_a_mistral_file_without_a_window_key_slides_over_transformers_4096_tokens() -> None:
    raw = {k: v for k, v in _config(model_type="mistral").items() if k != "max_position_embeddings"}
    model = build_model(model_config_from_hf(raw), torch.float32, "meta")
    assert {layer.sliding_window for layer in model.attention_layers()} == {4096}


@pytest.mark.unit
@pytest.mark.parametrize("model_type", ["mistral", "phi3"])
@pytest.mark.parametrize("window", [0, -4, "8", 8.5, True])
def test_a_window_that_is_not_a_positive_integer_is_refused(model_type: str, window: Any) -> None:
    with pytest.raises(ValueError, match="sliding_window must be a positive integer or null"):
        model_config_from_hf(_config(model_type=model_type, sliding_window=window))


@pytest.mark.unit
def test_phi3_refuses_rope_types_transformers_refuses_for_it() -> None:
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="unsupported rope type 'linear' on phi3"):
        model_config_from_hf(_config(model_type="phi3", rope_parameters=rope))


@pytest.mark.unit
def test_longrope_factors_of_the_wrong_length_are_refused() -> None:
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7}
    raw = _config(model_type="phi3", original_max_position_embeddings=16, rope_parameters=rope)
    config = model_config_from_hf(raw)
    with pytest.raises(ValueError, match="longrope needs a long_factor of 8 numbers"):
        build_model(config, torch.float32, "meta")


@pytest.mark.unit
def test_phi3_reads_an_older_config_s_top_level_rope_keys(tmp_path: Path) -> None:
    """Before transformers 5, config.json kept partial_rotary_factor and the LongRoPE factors
    outside `rope_parameters` (in `rope_scaling`)."""
    reference = save_tiny_model(tmp_path, CASES["phi3-longrope"])
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw |= {"rope_theta": rope.pop("rope_theta"), "partial_rotary_factor": 0.75}
    del rope["partial_rotary_factor"], rope["rope_type"]
    raw["rope_scaling"] = {"type": "longrope", **rope}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    ids = _ids("phi3-longrope")

    assert (dense_logits(model, ids) - reference_logits(reference, ids)).abs().max() <= 1e-4
