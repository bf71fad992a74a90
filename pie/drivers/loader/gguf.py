"""Convert a GGUF file into an HF-style folder: config.json from its metadata, float32
safetensors under HF names (llama q/k rows restored to HF order, Gemma norms back to their
offsets from one) and the tokenizer files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from pie.drivers.models.gemma3 import Gemma3ForCausalLM

_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

_BLOCK_NAMES_BY_TYPE = {"gemma3_text": _GEMMA_BLOCK_NAMES}

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and tokenizer files for gguf_path into out_dir."""
    try:
        reader = GGUFReader(gguf_path)
        config = hf_config(reader)
        tensors = hf_tensors(reader, config)
    except ValueError as e:
        raise ValueError(f"cannot convert {gguf_path}: {e}") from e
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out_dir / "model.safetensors"))
    _convert_tokenizer(gguf_path, out_dir)


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    """An HF config.json dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # llama.cpp folds Llama 3.1 rope scaling into this tensor and drops its parameters.
        raise ValueError("unsupported GGUF: rope frequency factors (rope_freqs.weight)")
    model_type, hf_class = _ARCHITECTURES[arch]
    meta = {key: _field(reader, f"{arch}.{key}") for key in _ARCH_KEYS}
    hidden, heads = meta["embedding_length"], meta["attention.head_count"]
    names = {t.name for t in reader.tensors}
    config = {
        "model_type": model_type,
        "architectures": [hf_class],
        "hidden_size": hidden,
        "intermediate_size": meta["feed_forward_length"],
        "num_hidden_layers": meta["block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta["attention.head_count_kv"] or heads,
        "head_dim": meta["attention.key_length"] or meta["rope.dimension_count"] or hidden // heads,
        "rope_theta": meta["rope.freq_base"] or 10000.0,
        "rms_norm_eps": meta["attention.layer_norm_rms_epsilon"],
        "vocab_size": _tensor_rows(reader, "token_embd.weight"),
        "max_position_embeddings": meta["context_length"],
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(reader),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        config |= _gemma3_config(reader, config)
    return config


_ARCH_KEYS = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "rope.dimension_count",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "context_length",
)


def _gemma3_config(reader: GGUFReader, config: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 3 adds. Its GGUF files leave out the 5:1 layer pattern, the local rope theta
    and the query scale; llama.cpp hard-codes them (the scale by model size), and so does this."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    # llama.cpp: the 27B model (62 layers) scales queries by hidden / heads, the rest by head_dim.
    scalar = hidden // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    global_rope = {**_rope_scaling(reader, "gemma3"), "rope_theta": config["rope_theta"]}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": _field(reader, "gemma3.attention.sliding_window"),
        "layer_types": list(Gemma3ForCausalLM.layer_kinds({"num_hidden_layers": layers})),
        "query_pre_attn_scalar": scalar,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": global_rope,
        },
    }


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any]:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default"}
    if kind == "linear":
        return {"rope_type": "linear", "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    raise ValueError(f"unsupported GGUF rope scaling {kind!r}")


def hf_tensors(reader: GGUFReader, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its HF name."""
    tensors = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit=" tensors", leave=False):
        name = hf_name(tensor.name, config["model_type"])
        weights = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        tensors[name] = torch.from_numpy(_restore(weights, name, config))
    return tensors


def hf_name(gguf_name: str, model_type: str = "llama") -> str:
    """GGUF tensor name -> HF parameter name; ValueError for tensors we cannot place."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    block_names = _BLOCK_NAMES_BY_TYPE.get(model_type, _BLOCK_NAMES)
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match[2] in block_names:
        return f"model.layers.{match[1]}.{block_names[match[2]]}.{match[3]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def _restore(weights: np.ndarray, name: str, config: dict[str, Any]) -> np.ndarray:
    """Undo what llama.cpp's converter changed in a tensor of this architecture."""
    if config["model_type"] == "gemma3_text" and name.endswith("norm.weight"):
        # ggml multiplies by a norm's weight as stored, so Gemma's 1 + w was stored.
        return weights - np.float32(1.0)
    return unpermute(weights, name, config)


def unpermute(weights: np.ndarray, name: str, config: dict[str, Any]) -> np.ndarray:
    """Undo llama.cpp's conversion of llama q/k rows from rotate-half to interleaved pairs.

    The converter regrouped each head's rows [half0 | half1] as (row i of half0, row i of half1)
    pairs; viewing rows as (heads, pair index, 2) and swapping the last two axes restores them.
    """
    if config["model_type"] != "llama":
        return weights
    if name.endswith("self_attn.q_proj.weight"):
        heads = config["num_attention_heads"]
    elif name.endswith("self_attn.k_proj.weight"):
        heads = config["num_key_value_heads"]
    else:
        return weights
    rows = weights.shape[0]
    grouped = weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weights.shape))


def _convert_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    # transformers rebuilds a fast tokenizer (and the chat template) from GGUF metadata; saving it
    # once means later loads read plain tokenizer.json without the slow GGUF parse.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _tensor_rows(reader: GGUFReader, name: str) -> int:
    for tensor in reader.tensors:
        if tensor.name == name:
            return int(tensor.shape[-1])
    raise ValueError(f"GGUF has no tensor {name!r}")


def _eos_ids(reader: GGUFReader) -> list[int]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = [_field(reader, key) for key in keys]
    return list(dict.fromkeys(i for i in ids if i is not None))
