"""Our Tokenizer on the converted default model against transformers' tokenizer read straight
from the same GGUF: same ids, same text, same chat prompt, and the right stop tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pie.drivers.tokenizer import Tokenizer

pytest_plugins = ("model_fixtures",)
pytestmark = pytest.mark.model

TEXTS = [
    "Hello world",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Grüße aus Köln, 世界 🍰",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>",
]
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def ours(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def reference(default_gguf: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours: Tokenizer, reference: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
        ids, skip_special_tokens=True
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference: Any, add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == expected


def test_stop_tokens_include_the_turn_end(ours: Tokenizer) -> None:
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end is not None and ours.id_to_token(im_end) == "<|im_end|>"
    assert im_end in ours.eos_ids and im_end in ours.stop_token_ids
    assert ours.special_tokens["<|im_start|>"] == ours.bos_id == 1
    assert ours.vocab_size == 49152


TEMPLATE_WITH_EXTRAS = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | tojson }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)


def test_chat_template_extras_match_transformers(tmp_path: Path) -> None:
    """Templates use HF's tojson (no HTML escaping), the generation block, raise_exception,
    special tokens written as dicts, and the list form of chat_template."""
    import json

    from tests.tiny_models import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, 320)
    settings_file = tmp_path / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    settings["bos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    settings["chat_template"] = [{"name": "default", "template": TEMPLATE_WITH_EXTRAS}]
    settings_file.write_text(json.dumps(settings))
    for stale in tmp_path.glob("chat_template.*"):
        stale.unlink()
    ours = Tokenizer.from_folder(tmp_path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    messages = [
        {"role": "user", "content": '<b>fox</b> & "dog"'},
        {"role": "assistant", "content": "ünïcode <ok>"},
    ]

    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert '"ünïcode <ok>"' in expected and ours.bos_id == ours.token_to_id("<|endoftext|>")
    assert ours.vocab_size == len(reference)
    with pytest.raises(Exception, match="bad role"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
