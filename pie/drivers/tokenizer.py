"""Text <-> token ids and chat formatting for one model, read from the HF tokenizer files in
its folder with the `tokenizers` library alone (transformers' tokenizer classes cost ~100 MB of
resident memory and seconds of start-up for the same ids)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from pie.drivers.chat_template import ChatTemplate

# End-of-turn markers that chat templates close each message with; a model must stop on them
# even when its config names another eos token.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
# What transformers' `clean_up_tokenization_spaces` undoes after decoding, in its order.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class Tokenizer:
    """A model's fast tokenizer, its special tokens and chat template, and the stop tokens."""

    def __init__(
        self,
        backend: Backend,
        settings: dict[str, Any],
        chat_template: str | None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._vocab = backend
        self._clean_up = bool(settings.get("clean_up_tokenization_spaces", False))
        self._special_text = {
            key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(settings.get(key)))
        }
        self.chat_template_source = chat_template
        self._chat: ChatTemplate | None = None
        self.eos_ids: tuple[int, ...] = self._collect_eos_ids(tuple(eos_token_ids))
        self.stop_token_ids: frozenset[int] = frozenset(self.eos_ids)
        """eos_ids as a set, for a per-token membership test."""

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template from folder, never
        from the network; eos_token_ids (usually the model config's) join the stop set."""
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        settings = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(backend, settings, _chat_template(folder, settings), eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return int(self._vocab.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self) -> int | None:
        text = self._special_text.get("bos_token")
        return None if text is None else self.token_to_id(text)

    @property
    def special_tokens(self) -> dict[str, int]:
        decoder = self._vocab.get_added_tokens_decoder()
        return {token.content: i for i, token in decoder.items() if token.special}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self._vocab.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        text: str = self._vocab.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def backend_json(self) -> str:
        """The tokenizer serialised as tokenizer.json, added tokens included, without padding
        or truncation (what the grammar engine builds its token trie from)."""
        backend = copy.copy(self._vocab)
        backend.no_padding()
        backend.no_truncation()
        text: str = backend.to_str()
        return text

    def token_to_id(self, token: str) -> int | None:
        found: int | None = self._vocab.token_to_id(token)
        return found

    def id_to_token(self, token_id: int) -> str | None:
        found: str | None = self._vocab.id_to_token(token_id)
        return found

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text the model's own chat template makes of messages."""
        if self.chat_template_source is None:
            raise ValueError("this model's tokenizer has no chat template")
        if self._chat is None:
            self._chat = ChatTemplate(self.chat_template_source, self._special_text)
        return self._chat.render(messages, add_generation_prompt)

    def _collect_eos_ids(self, config_eos: tuple[int, ...]) -> tuple[int, ...]:
        """Config eos, tokenizer eos, then the turn-end tokens the chat template emits."""
        eos_text = self._special_text.get("eos_token")
        ids = [*config_eos, None if eos_text is None else self.token_to_id(eos_text)]
        template = self.chat_template_source or ""
        ids += [self.token_to_id(t) for t in _TURN_END_TOKENS if t in template]
        return tuple(dict.fromkeys(i for i in ids if i is not None))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(folder: Path, settings: dict[str, Any]) -> str | None:
    """chat_template.jinja when present (newer files), else a processor's chat_template.json,
    else tokenizer_config.json's entry,
    which may be a list of named templates of which "default" is the chat one."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    # A multimodal checkpoint's processor keeps its template (the one that places media) here.
    processor = folder / "chat_template.json"
    if processor.is_file():
        saved = json.loads(processor.read_text()).get("chat_template")
        if isinstance(saved, str):
            return saved
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None
