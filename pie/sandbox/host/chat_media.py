"""Media in chat messages: a message's content marks each medium with a sentinel
(`\\ue000KIND\\ue001`); the template renders typed content parts, and the placeholder it writes
for each medium becomes that sentinel again, so the program places the medium's span there."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pie.sandbox.host.failure import HostFailure
from pie.sandbox.host.records import ModelView

OPEN, CLOSE = "\ue000", "\ue001"
KINDS = ("image", "video", "audio")
SENTINEL = re.compile(f"{OPEN}({'|'.join(KINDS)}){CLOSE}")


def has_media(messages: list[dict[str, Any]]) -> bool:
    return any(OPEN in m["content"] or CLOSE in m["content"] for m in messages)


def typed_messages(view: ModelView, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose content holds sentinels, with that content as a list of typed parts."""
    placeholders = _placeholders(view)
    typed = []
    for message in messages:
        content = message["content"]
        if OPEN not in content and CLOSE not in content:
            typed.append(message)
            continue
        typed.append({**message, "content": _parts(view, content, placeholders)})
    return typed


def restore_sentinels(view: ModelView, rendered: str, messages: list[dict[str, Any]]) -> str:
    """The render with each medium's placeholder replaced by its sentinel; a render that does
    not hold one placeholder per medium is refused."""
    placeholders = _placeholders(view)
    wanted = [k for m in messages for k in SENTINEL.findall(m["content"])]
    pattern = "|".join(re.escape(placeholders[k]) for k in sorted(set(wanted)))
    found: list[str] = []

    def mark(match: re.Match[str]) -> str:
        kind = next(k for k in set(wanted) if placeholders[k] == match.group(0))
        found.append(kind)
        return f"{OPEN}{kind}{CLOSE}"

    restored = re.sub(pattern, mark, rendered) if pattern else rendered
    if found != wanted:
        raise HostFailure(
            "invalid",
            f"model {view.name!r}: the chat template placed {len(found)} of the messages' "
            f"{len(wanted)} media ({', '.join(wanted)}); it has no place for them in this order",
        )
    return restored


def _placeholders(view: ModelView) -> Mapping[str, str]:
    return {} if view.media is None else view.media.chat_placeholders


def _parts(view: ModelView, content: str, placeholders: Mapping[str, str]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    last = 0
    for match in SENTINEL.finditer(content):
        _text_part(parts, content[last : match.start()])
        kind = match.group(1)
        if kind not in placeholders or kind not in view.inputs:
            reads = ", ".join(view.inputs)
            raise HostFailure(
                "unsupported-media",
                f"model {view.name!r} takes no {kind} in chat messages (it reads {reads})",
            )
        # Templates test either the part's type or a key named after the kind.
        parts.append({"type": kind, kind: ""})
        last = match.end()
    _text_part(parts, content[last:])
    return parts


def _text_part(parts: list[dict[str, Any]], text: str) -> None:
    if OPEN in text or CLOSE in text:
        raise HostFailure("invalid", "message text holds U+E000 or U+E001 outside a media marker")
    if text:
        parts.append({"type": "text", "text": text})
