"""Text <-> token ids and chat formatting for one model, read from the HF tokenizer files in
its folder."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# End-of-turn markers that chat templates close each message with; a model must stop on them
# even when its config names another eos token.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class Tokenizer:
    """A local HF fast tokenizer plus the stop-token facts the engine needs."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self._hf = hf_tokenizer
        self._vocab = hf_tokenizer.backend_tokenizer
        self.eos_ids: tuple[int, ...] = self._collect_eos_ids(tuple(eos_token_ids))
        self.stop_token_ids: frozenset[int] = frozenset(self.eos_ids)
        """eos_ids as a set, for a per-token membership test."""

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load tokenizer.json / tokenizer_config.json from folder, never from the network;
        eos_token_ids (usually the model config's) join the stop set."""
        from transformers import AutoTokenizer

        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True), eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    @property
    def bos_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def special_tokens(self) -> dict[str, int]:
        decoder = self._hf.added_tokens_decoder
        return {token.content: i for i, token in decoder.items() if token.special}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The tokenizer serialised as tokenizer.json, added tokens included, without padding
        or truncation (what the grammar engine builds its token trie from)."""
        backend = copy.copy(self._vocab)
        backend.no_padding()
        backend.no_truncation()
        text: str = backend.to_str()
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._vocab.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text the model's own chat template makes of messages."""
        if not self._hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        return self._hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _collect_eos_ids(self, config_eos: tuple[int, ...]) -> tuple[int, ...]:
        """Config eos, tokenizer eos, then the turn-end tokens the chat template emits."""
        ids = [*config_eos, self._hf.eos_token_id]
        template = self._hf.chat_template or ""
        ids += [self.token_to_id(t) for t in _TURN_END_TOKENS if t in template]
        return tuple(dict.fromkeys(i for i in ids if i is not None))
