"""Tiny random checkpoints (Llama, Qwen2, Qwen3 variants) written by transformers with a small
trained byte-level tokenizer, and transformers' own logits for them: the reference that model
files and drivers are compared against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

TINY_TOLERANCE = 1e-4
"""Max abs logit difference allowed against transformers, float32, tiny random models."""

VOCAB = 320
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)
TINY_CASES: dict[str, dict[str, Any]] = {
    "llama-llama3-rope-sharded": dict(
        model_type="llama",
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "llama-linear-rope-tied": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    ),
    "qwen2-qkv-bias": dict(model_type="qwen2"),
    "qwen3-qk-norm-wide-heads": dict(model_type="qwen3", head_dim=32),
}
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! 12345", "pie serves"]


def reference_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids[None]).logits[0].float()


def save_tiny_model(folder: Path, case: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """A random transformers model written to folder (sharded), with every weight perturbed so
    biases and norm scales are not left at their zero/one initial values."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{**TINY_SHAPE, **case})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder, max_shard_size="200KB")
    write_tiny_tokenizer(folder, VOCAB)
    return model


def write_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE with at most vocab_size ids, saved as HF tokenizer files in folder."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(folder)
