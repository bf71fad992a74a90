"""Gemma 2 and Gemma 3 against transformers: tiny random checkpoints through the dense reference
attention, the torch driver and the whole engine, and the real Gemma-3-270M from its GGUF."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio
from dense_attention import dense_logits
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from pie.actors.generate import generate
from pie.config import EngineConfig, with_overrides
from pie.drivers.batch import ForwardBatch
from pie.drivers.factory import build_torch_driver
from pie.drivers.loader import LoadedModel, load_model
from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.loader.resolve import packaged_gguf, resolve_model
from pie.drivers.models import build_model
from pie.drivers.quantize import quantize_int8
from pie.drivers.tokenizer import Tokenizer
from pie.drivers.torch_driver import TorchDriver
from pie.engine import open_engine
from pie.events.forward import ForwardRequest
from pie.events.sampling import Argmax, LogitsOutput, RawLogits, SamplingSlot
from tests.engine_greedy import assert_matches, engine_greedy, hf_greedy
from tests.tiny_models import TINY_SHAPE, TINY_TOLERANCE, VOCAB, reference_logits, save_tiny_model

WINDOW = 6
GEMMA_CASES: dict[str, dict[str, Any]] = {
    "gemma2-softcaps": dict(
        model_type="gemma2",
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
    ),
    "gemma2-uncapped-listed-layers": dict(
        model_type="gemma2",
        head_dim=32,
        query_pre_attn_scalar=8,
        sliding_window=WINDOW,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        layer_types=["full_attention", "sliding_attention"],
    ),
    "gemma3-five-to-one-two-ropes": dict(
        model_type="gemma3_text",
        num_hidden_layers=6,
        head_dim=32,
        query_pre_attn_scalar=20,
        sliding_window=WINDOW,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
        },
    ),
}
PROMPT_LEN = 48
"""Eight times the window: most tokens see only part of what came before on sliding layers."""


def _ids(n: int = PROMPT_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(GEMMA_CASES))
def tiny(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """(transformers' model, the folder it was saved to) for one case."""
    return save_tiny_model(tmp_path, GEMMA_CASES[request.param]), tmp_path


@pytest.mark.unit
def test_tiny_gemma_matches_transformers(tiny: tuple[torch.nn.Module, Path]) -> None:
    reference, folder = tiny
    model = load_model(str(folder), torch.float32, "cpu").model
    ids = _ids()

    ours, theirs = dense_logits(model, ids), reference_logits(reference, ids)

    assert theirs.abs().max() > 0.1, "logits too small to reveal a mismatch"
    assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE


@pytest.mark.unit
def test_layers_follow_the_config(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, GEMMA_CASES["gemma3-five-to-one-two-ropes"])
    model = load_model(str(tmp_path), torch.float32, "cpu").model

    layers = model.attention_layers()

    windows = [layer.sliding_window for layer in layers]
    assert windows == [WINDOW] * 5 + [None]
    assert {(layer.softcap, layer.scale) for layer in layers} == {(None, 20**-0.5)}
    assert model.get_buffer("model.rotary.sliding_attention.cos").shape[-1] == 16


@pytest.mark.unit
@pytest.mark.parametrize("option", ["sliding_window", "softcap", "scale"])
def test_each_attention_option_moves_the_logits(tmp_path: Path, option: str) -> None:
    """The tolerance above would catch a driver that ignored any one of them."""
    save_tiny_model(tmp_path, GEMMA_CASES["gemma2-softcaps"])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    ids = _ids()
    without = [attrs.evolve(layer, **{option: None}) for layer in model.attention_layers()]

    moved = (dense_logits(model, ids) - dense_logits(model, ids, without)).abs().max()

    assert moved.item() > 100 * TINY_TOLERANCE


def _driver(loaded: LoadedModel) -> TorchDriver:
    return TorchDriver(
        loaded.model,
        loaded.config,
        page_size=4,
        num_pages=32,
        max_batch_tokens=256,
        max_batch_requests=8,
        device="cpu",
        dtype=torch.float32,
        model_name="tiny-gemma",
        seed=0,
    )


def _pass(driver: TorchDriver, ids: Sequence[int], done: int) -> list[torch.Tensor]:
    """Logits of every token of `ids` appended after `done` tokens of context 0."""
    request = ForwardRequest(
        corr=0,
        requester="test",
        context=0,
        tokens=tuple(ids),
        positions=tuple(range(done, done + len(ids))),
        kv_start=done,
        pages=tuple(range(-(-(done + len(ids)) // 4))),
        slots=tuple(SamplingSlot(index=i, op=RawLogits()) for i in range(len(ids))),
    )
    outputs = driver.forward(ForwardBatch.from_requests([request]))
    assert all(isinstance(out, LogitsOutput) for out in outputs)
    return [torch.tensor(out.values) for out in outputs if isinstance(out, LogitsOutput)]


@pytest.mark.unit
def test_torch_driver_matches_transformers(tiny: tuple[torch.nn.Module, Path]) -> None:
    """A 30-token prefill, then one token per pass over KV pages past the window."""
    reference, folder = tiny
    loaded = load_model(str(folder), torch.float32, "cpu")
    driver, ids = _driver(loaded), _ids().tolist()

    rows = _pass(driver, ids[:30], 0)
    for i in range(30, len(ids)):
        rows += _pass(driver, ids[i : i + 1], i)

    theirs = reference_logits(reference, torch.tensor(ids))
    assert (torch.stack(rows) - theirs).abs().max().item() <= TINY_TOLERANCE


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [250, 11, 64, 64, 9, 30, 31], [8]]
NEW_TOKENS = 20
"""Every generation runs past the window of 6."""


@pytest.mark.integration
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(GEMMA_CASES))
async def test_engine_greedy_equals_transformers(tmp_path: Path, case: str, device: str) -> None:
    reference = save_tiny_model(tmp_path, GEMMA_CASES[case]).to(device)
    config = with_overrides(
        EngineConfig(),
        model={"path": str(tmp_path), "dtype": "float32", "device": device},
        kv={"num_pages": 256, "page_size": 4},
    )
    expected = [hf_greedy(reference, ids, NEW_TOKENS, device) for ids in PROMPTS]
    assert_matches(await engine_greedy(config, PROMPTS, NEW_TOKENS), expected)


@pytest.mark.unit
def test_int8_weights_stay_near_the_float32_reference(tmp_path: Path) -> None:
    reference = save_tiny_model(tmp_path, GEMMA_CASES["gemma3-five-to-one-two-ropes"])
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    calibration = _ids(64, seed=2).tolist()

    replaced = quantize_int8(model, calibration)

    ids = _ids()
    ours, theirs = dense_logits(model, ids), reference_logits(reference, ids)
    assert replaced == 6 * 4
    # Measured 0.046: six layers of int8 rounding, against 2 in test_int8_weights' 0.05.
    assert float((ours - theirs).norm() / theirs.norm()) < 0.08
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.85


@pytest.mark.unit
def test_the_cuda_driver_refuses_gemma_layers(tmp_path: Path) -> None:
    from pie.drivers.cuda_driver import CudaDriver

    save_tiny_model(tmp_path, GEMMA_CASES["gemma2-softcaps"])
    loaded = load_model(str(tmp_path), torch.float32, "cpu")

    with pytest.raises(ValueError, match="use the torch driver"):
        CudaDriver(
            loaded.model,
            loaded.config,
            kernels=None,
            page_size=4,
            num_pages=8,
            max_batch_tokens=64,
            max_batch_requests=4,
            device="cpu",
            dtype=torch.float32,
            model_name="tiny-gemma",
        )


LEGACY_GEMMA3 = dict(
    TINY_SHAPE,
    model_type="gemma3_text",
    num_hidden_layers=8,
    head_dim=16,
    sliding_window=16,
    sliding_window_pattern=4,
    rope_theta=500000.0,
    rope_local_base_freq=20000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
)


@pytest.mark.unit
def test_gemma3_reads_the_older_config_keys_as_transformers_does() -> None:
    """Before layer_types and nested rope_parameters: a layer pattern, a local rope theta, and
    rope scaling that applies to the global layers only."""
    theirs = AutoConfig.for_model(**LEGACY_GEMMA3)
    tables = Gemma3RotaryEmbedding(theirs)
    model = build_model(model_config_from_hf(dict(LEGACY_GEMMA3)), torch.float32, "cpu")

    slides = [layer.sliding_window is not None for layer in model.attention_layers()]

    assert slides == [kind == "sliding_attention" for kind in theirs.layer_types]
    assert slides.count(False) == 2
    for kind in ("sliding_attention", "full_attention"):
        ours = model.get_buffer(f"model.rotary.{kind}.cos")[1]
        inv_freq = tables.get_buffer(f"{kind}_inv_freq")
        torch.testing.assert_close(ours, torch.cos(inv_freq), rtol=0, atol=1e-7)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["chunked_attention"] * 8}, "chunked_attention"),
        ({"layer_types": ["full_attention"] * 3}, "3 layer_types for 8 layers"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "'yarn' for full_attention"),
        ({"sliding_window": None}, "need a sliding_window"),
    ],
)
def test_unsupported_gemma_configs_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_config_from_hf({**LEGACY_GEMMA3, **change})


@pytest.mark.unit
def test_gemma2_soft_caps_unless_the_config_sets_them_to_null() -> None:
    """Left out, the caps take transformers' defaults (50 on scores, 30 on logits)."""
    raw = dict(TINY_SHAPE, model_type="gemma2", head_dim=16)
    capped = build_model(model_config_from_hf(raw), torch.float32, "meta")
    uncapped = build_model(
        model_config_from_hf({**raw, "attn_logit_softcapping": None}), torch.float32, "meta"
    )

    theirs = AutoConfig.for_model(**raw)
    assert {layer.softcap for layer in capped.attention_layers()} == {50.0}
    assert capped.config.raw["final_logit_softcapping"] == theirs.final_logit_softcapping == 30.0
    assert theirs.attn_logit_softcapping == 50.0
    assert {layer.softcap for layer in uncapped.attention_layers()} == {None}


# The real Gemma-3-270M (Q4_K_M GGUF) against transformers' own loading of the same file: both
# dequantize with gguf and take one from llama.cpp's stored norm weights (measured: every tensor
# equal, logits bitwise equal in float32), so greedy tokens must agree exactly.
GEMMA3_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Count with me: " + ", ".join(str(i) for i in range(1, 130)),
]
GEMMA3_NEW_TOKENS = 16


def _cache(pytestconfig: pytest.Config, factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder in pytest's cache (kept across runs), or a temporary one when it is disabled."""
    cache = getattr(pytestconfig, "cache", None)
    return factory.mktemp(name) if cache is None else cache.mkdir(name)


@pytest.fixture(scope="session")
def model_cache(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _cache(pytestconfig, tmp_path_factory, "pie-models")


@pytest.fixture(scope="session")
def gemma3_gguf(model_cache: Path) -> Path:
    """The package's GGUF, joined from its parts into the cache as the alias does."""
    return packaged_gguf("gemma3-270m", model_cache)


@pytest.fixture(scope="session")
def gemma3_dir(gemma3_gguf: Path, model_cache: Path) -> Path:
    """Its conversion by pie through the `gemma3-270m` alias, cached beside the default
    model's."""
    folder = resolve_model("gemma3-270m", cache_dir=model_cache)
    assert folder == resolve_model(str(gemma3_gguf), cache_dir=model_cache)
    return folder


@pytest.fixture(scope="module")
def gemma3_prompts(gemma3_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_folder(gemma3_dir)
    return [tokenizer.encode(text, add_special_tokens=True) for text in GEMMA3_PROMPTS]


@pytest.fixture(scope="module")
def gemma3_reference(gemma3_gguf: Path) -> torch.nn.Module:
    """transformers' own loading of the GGUF (about a minute: it parses the whole vocabulary)."""
    return AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent,
        gguf_file=gemma3_gguf.name,
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()


@pytest.mark.model
def test_gemma3_270m_config_from_gguf(gemma3_dir: Path) -> None:
    config = model_config_from_hf(json.loads((gemma3_dir / "config.json").read_text()))
    layers = build_model(config, torch.float32, "meta").attention_layers()

    assert (config.model_type, config.num_layers, config.head_dim) == ("gemma3_text", 18, 256)
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (4, 1, 262144)
    assert [layer.sliding_window for layer in layers] == ([512] * 5 + [None]) * 3
    assert {layer.scale for layer in layers} == {1 / 16}
    assert config.tie_word_embeddings and config.eos_token_ids == (1,)


@pytest.mark.model
def test_gemma3_270m_weights_equal_transformers_gguf_loading(
    gemma3_reference: torch.nn.Module, gemma3_dir: Path
) -> None:
    """Same dequantization, the norms' stored 1 + w taken back to w, q/k rows left in order."""
    ours = load_file(gemma3_dir / "model.safetensors")
    theirs = gemma3_reference.state_dict()

    assert set(ours) == set(theirs) - {"lm_head.weight"}
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in ours.items())


@pytest.mark.model
def test_gemma3_270m_tokenizer_matches_transformers_gguf(
    gemma3_gguf: Path, gemma3_dir: Path
) -> None:
    theirs = AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)
    ours = Tokenizer.from_folder(gemma3_dir)
    texts = [
        *GEMMA3_PROMPTS,
        "  Two spaces, a tab\tand a newline\n: naïve café 日本語 🙂",
        "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n",
    ]

    for text in texts:
        assert ours.encode(text, add_special_tokens=True) == theirs(text).input_ids
        assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids
        assert ours.decode(ours.encode(text)) == text
    assert ours.bos_id == 2 and ours.encode("Hello")[0] != 2
    assert ours.encode("<start_of_turn>") == [ours.token_to_id("<start_of_turn>")]


@pytest.mark.model
async def test_gemma3_270m_engine_greedy_equals_transformers(
    gemma3_reference: torch.nn.Module, gemma3_dir: Path, gemma3_prompts: list[list[int]]
) -> None:
    """Three prompts at once, the last one longer than the 512-token window."""
    expected = [
        hf_greedy(gemma3_reference, ids, GEMMA3_NEW_TOKENS, "cpu") for ids in gemma3_prompts
    ]
    config = with_overrides(
        EngineConfig(),
        model={"path": str(gemma3_dir), "dtype": "float32", "device": "cpu"},
        kv={"num_pages": 128},
    )
    driver, tokenizer = await trio.to_thread.run_sync(build_torch_driver, config)
    got: dict[int, list[int]] = {}
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:

        async def run(i: int) -> None:
            async with engine.requester() as req:
                out = await generate(
                    req, gemma3_prompts[i], max_tokens=GEMMA3_NEW_TOKENS, sampler=Argmax()
                )
                got[i] = list(out.tokens)

        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for i in range(len(gemma3_prompts)):
                    nursery.start_soon(run, i)

    assert len(gemma3_prompts[-1]) > 512
    assert [got[i] for i in range(len(gemma3_prompts))] == expected
    assert tokenizer.decode(expected[2]).startswith(", 130, 131")
