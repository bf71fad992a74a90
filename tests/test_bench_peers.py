"""`pie bench peers` without llama.cpp: the GGUF rewritten at another precision keeps its
metadata and tensors, and the summary takes ratios round by round."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from pie.cli.bench.peer_models import at_precision
from pie.cli.bench.peers import summarise

pytestmark = pytest.mark.unit


def _tiny_gguf(path: Path) -> np.ndarray:
    """A GGUF with one Q4_1 matrix, one F32 norm and some metadata; the matrix's values."""
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((8, 64)).astype(np.float32)
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor(
        "blk.0.ffn_up.weight",
        quantize(matrix, GGMLQuantizationType.Q4_1),
        raw_dtype=GGMLQuantizationType.Q4_1,
    )
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantize(quantize(matrix, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)


def test_a_file_rewritten_at_q8_0_keeps_metadata_norms_and_values(tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    values = _tiny_gguf(source)

    target = at_precision(source, "Q8_0", tmp_path / "cache")
    again = at_precision(source, "Q8_0", tmp_path / "cache")

    reader = GGUFReader(target)
    tensors = {t.name: t for t in reader.tensors}
    assert again == target and at_precision(source, "Q4_1", tmp_path / "cache") == source
    assert tensors["blk.0.ffn_up.weight"].tensor_type == GGMLQuantizationType.Q8_0
    assert tensors["blk.0.attn_norm.weight"].tensor_type == GGMLQuantizationType.F32
    up = tensors["blk.0.ffn_up.weight"]
    rewritten = dequantize(up.data, up.tensor_type)
    assert np.abs(rewritten - values).max() <= np.abs(values).max() / 127
    assert reader.fields["general.name"].contents() == "tiny"
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert reader.fields["general.file_type"].contents() == 7


def test_ratios_are_taken_round_by_round_and_headlined_at_the_shared_precision() -> None:
    def figures(scale: float, **extra: object) -> dict[str, object]:
        keys = ("decode_tps_batch1", "decode_tps_16", "prefill_tps", "peak_rss_mb")
        return {**{k: scale for k in keys}, **extra}

    runs = {
        "int4/q4_1": {
            "pie": [figures(10.0), figures(30.0)],
            "peer": [figures(20.0, extra_buffers=True), figures(20.0, extra_buffers=False)],
        },
        "f32": {"pie": [figures(1.0)], "peer": []},
    }
    out = summarise(runs, argparse.Namespace(threads=1, rounds=2))

    entry = out["precisions"]["int4/q4_1"]
    assert entry["ratio_decode_batch1"] == {"median": 1.0, "min": 0.5, "max": 1.5}
    assert entry["pie"]["prefill_tps"]["median"] == 20.0
    assert out["ratio_decode_16"] == 1.0 and out["ratio_precision"] == "int4/q4_1"
    assert "ratio_prefill" not in out["precisions"]["f32"]
    assert out["peer_extra_buffers"] is False
