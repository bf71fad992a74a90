"""The `model` interface: models, the tokenizer and the chat template, answered on the guest
thread without a trip to the engine."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance

from pie.sandbox.host import chat_media
from pie.sandbox.host.records import ModelView
from pie.sandbox.host.state import HostFailure, current, host_call
from pie.sandbox.wasm import add_host_func, record

INTERFACE = "pie:inferlet/model@0.1.0"


def model_view(handle: int) -> ModelView:
    models = current().models
    if not 1 <= handle <= len(models):
        raise HostFailure("no-such-model", f"no model handle {handle}")
    return models[handle - 1]


def models() -> list[str]:
    return [m.name for m in current().models]


def load(name: str) -> int:
    names = [m.name for m in current().models]
    if name in ("", "default"):
        return 1
    if name not in names:
        raise HostFailure("no-such-model", f"no model {name!r}; the engine serves {names}")
    return names.index(name) + 1


def info(model: int) -> Any:
    view = model_view(model)
    return record(
        name=view.name,
        vocab_size=view.vocab_size,
        page_size=view.page_size,
        max_batch_tokens=view.max_batch_tokens,
        adapters=list(view.adapters),
        inputs=list(view.inputs),
        outputs=list(view.outputs),
    )


def encode(model: int, text: str) -> list[int]:
    view = model_view(model)
    with view.lock:
        return list(view.tokenizer.encode(text))


def decode(model: int, tokens: list[int]) -> str:
    view = model_view(model)
    _check_tokens(view, tokens)
    with view.lock:
        text: str = view.tokenizer.decode(tokens)
    return text


def token_texts(model: int, tokens: list[int]) -> list[str]:
    view = model_view(model)
    _check_tokens(view, tokens)
    with view.lock:
        return [view.tokenizer.decode([t]) for t in tokens]


def special_tokens(model: int) -> list[Any]:
    specials = model_view(model).tokenizer.special_tokens
    return [record(id=i, text=t) for t, i in sorted(specials.items(), key=lambda kv: kv[1])]


def stop_tokens(model: int) -> list[int]:
    return sorted(model_view(model).tokenizer.stop_token_ids)


def format_chat(model: int, messages: list[Any], cue: bool) -> str:
    """The template's render; media marked in the messages come back marked where the
    template places them (pie.sandbox.host.chat_media)."""
    view = model_view(model)
    chat = [{"role": m.role, "content": m.content} for m in messages]
    media = chat_media.has_media(chat)
    typed = chat_media.typed_messages(view, chat) if media else chat
    try:
        with view.lock:
            text: str = view.tokenizer.apply_chat_template(typed, add_generation_prompt=cue)
    except Exception as exc:  # template errors (jinja, role checks) come back to the guest
        raise HostFailure("invalid", f"the chat template refused these messages: {exc}") from exc
    return chat_media.restore_sentinels(view, text, chat) if media else text


def _check_tokens(view: ModelView, tokens: list[int]) -> None:
    bad = [t for t in tokens if not 0 <= t < view.vocab_size]
    if bad:
        raise HostFailure("invalid", f"token ids {bad[:5]} outside the vocabulary")


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "models", models)
    for fn in (
        load,
        info,
        encode,
        decode,
        token_texts,
        special_tokens,
        stop_tokens,
        format_chat,
    ):
        add_host_func(instance, fn.__name__.replace("_", "-"), host_call(fn))
