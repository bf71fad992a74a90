"""Our model files against transformers on the same weights: tiny random Llama / Qwen2 / Qwen3
checkpoints, and the real SmolLM2 through our GGUF conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dense_attention import dense_logits
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pie.drivers.loader import LoadedModel, load_model, resolve
from pie.drivers.loader.config import model_config_from_hf
from tests.tiny_models import (
    TINY_CASES,
    TINY_SHAPE,
    TINY_TOLERANCE,
    VOCAB,
    reference_logits,
    save_tiny_model,
)

pytest_plugins = ("model_fixtures",)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(TINY_CASES))
def test_tiny_model_matches_transformers(tmp_path: Path, name: str) -> None:
    reference = save_tiny_model(tmp_path, TINY_CASES[name])
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))

    ours, theirs = dense_logits(loaded.model, ids), reference_logits(reference, ids)

    assert ours.dtype == torch.float32 and ours.shape == (48, VOCAB)
    assert theirs.abs().max() > 0.1, "logits too small to reveal a mismatch"
    assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE


BF16_TOLERANCE = 0.15
"""bf16 keeps 8 mantissa bits: rounding in two layers moved logits of magnitude ~4 by up to
0.07 here against the float32 reference; this checks the dtype plumbing, not bit equality."""


@pytest.mark.unit
def test_bf16_model_gives_float32_logits_near_the_float32_reference(tmp_path: Path) -> None:
    reference = save_tiny_model(tmp_path, TINY_CASES["llama-llama3-rope-sharded"])
    loaded = load_model(str(tmp_path), torch.bfloat16, "cpu")
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))

    ours = dense_logits(loaded.model, ids)

    buffers = dict(loaded.model.named_buffers())
    assert loaded.model.get_parameter("model.embed_tokens.weight").dtype == torch.bfloat16
    assert buffers["model.rotary_emb.cos"].dtype == torch.float32
    assert ours.dtype == torch.float32
    assert (ours - reference_logits(reference, ids)).abs().max().item() <= BF16_TOLERANCE


@pytest.mark.unit
def test_sharded_checkpoint_is_split_across_files(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, TINY_CASES["llama-llama3-rope-sharded"])
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1


@pytest.mark.unit
def test_checkpoint_mismatch_names_missing_and_unexpected_weights(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, dict(model_type="llama"))
    merged: dict[str, torch.Tensor] = {}
    for shard in tmp_path.glob("model-*.safetensors"):
        merged |= load_file(shard)
        shard.unlink()
    (tmp_path / "model.safetensors.index.json").unlink()
    del merged["model.layers.1.self_attn.k_proj.weight"]
    merged["model.layers.1.extra.weight"] = torch.zeros(1)
    save_file(merged, tmp_path / "model.safetensors")

    with pytest.raises(ValueError) as error:
        load_model(str(tmp_path), torch.float32, "cpu")

    assert "model.layers.1.self_attn.qkv_proj.weight[k]" in str(error.value)
    assert "model.layers.1.extra.weight" in str(error.value)


@pytest.mark.unit
def test_unknown_model_type_lists_supported_types() -> None:
    with pytest.raises(ValueError, match=r"'mamba'.*\[.*'llama', .*'qwen3'.*\]"):
        model_config_from_hf({"model_type": "mamba"})


@pytest.mark.unit
def test_config_reads_legacy_rope_keys_and_eos_lists() -> None:
    config = model_config_from_hf(
        {
            **TINY_SHAPE,
            "model_type": "llama",
            "rope_theta": 500000.0,
            "eos_token_id": [7, 9],
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_ids == (7, 9)
    assert config.head_dim == 16


# SmolLM2 in float32. Both sides dequantize the same Q4_1 blocks with gguf and undo llama.cpp's
# q/k row permutation the same way, then run the same float32 ops in the same order (measured:
# bitwise equal logits), so the tolerance asked of tiny models holds for the real one too.
SMOLLM2_TOLERANCE = 1e-4

PROMPT = [
    {"role": "user", "content": "Give me three tips for writing clear Python functions."},
]


@pytest.fixture(scope="module")
def smollm2(default_model_dir: Path) -> LoadedModel:
    return load_model(str(default_model_dir), torch.float32, "cpu")


@pytest.fixture(scope="module")
def smollm2_reference(default_gguf: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        default_gguf.parent,
        gguf_file=default_gguf.name,
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()


@pytest.mark.model
def test_smollm2_logits_match_transformers_gguf(
    smollm2: LoadedModel, smollm2_reference: torch.nn.Module
) -> None:
    text = smollm2.tokenizer.apply_chat_template(PROMPT)
    ids = torch.tensor(smollm2.tokenizer.encode(text))

    ours, theirs = dense_logits(smollm2.model, ids), reference_logits(smollm2_reference, ids)

    assert ours.shape == (ids.numel(), 49152)
    assert (ours[-1] - theirs[-1]).abs().max().item() <= SMOLLM2_TOLERANCE
    assert (ours - theirs).abs().max().item() <= SMOLLM2_TOLERANCE
    assert ours[-1].argmax() == theirs[-1].argmax()


@pytest.mark.model
def test_smollm2_config_from_gguf(smollm2: LoadedModel) -> None:
    config = smollm2.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.eos_token_ids == (2,)


@pytest.mark.model
def test_second_resolve_reuses_the_converted_folder(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def convert_again(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(resolve, "convert_gguf", convert_again)
    cache_dir = default_model_dir.parents[1]
    again = resolve.resolve_model(None, cache_dir=cache_dir)
    assert again == default_model_dir
    assert (again / resolve.COMPLETE_MARKER).is_file()


@pytest.mark.unit
def test_half_written_conversion_is_redone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    interrupted = resolve.cache_folder(gguf, tmp_path / "cache")
    interrupted.mkdir(parents=True)
    (interrupted / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(resolve, "convert_gguf", lambda src, out: calls.append(out))

    folder = resolve.resolve_model(str(gguf), cache_dir=tmp_path / "cache")

    assert folder == interrupted and len(calls) == 1
    assert (folder / resolve.COMPLETE_MARKER).is_file()
    assert not (folder / "config.json").exists()


@pytest.mark.unit
def test_bad_specs_fail_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        resolve.resolve_model(str(tmp_path / "nowhere.gguf"))
    with pytest.raises(ValueError, match="has no config.json"):
        resolve.resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="weights.bin"):
        resolve.resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="cannot convert .*fake.gguf"):
        resolve.resolve_model(str(tmp_path / "fake.gguf"), cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []
