"""Media in chat messages on the host: sentinel-marked content becomes typed parts for the
model's own template, the template's placeholder for each medium comes back as the sentinel,
and media the model or its template cannot place are refused with the reason."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pie.drivers.chat_template import ChatTemplate
from pie.sandbox.host import chat_media
from pie.sandbox.host.failure import HostFailure

pytestmark = pytest.mark.unit

# The shape of Qwen2-VL's template: typed parts, a placeholder per image or video.
QWEN2_VL = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' or 'video' in c %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE, VIDEO = "\ue000image\ue001", "\ue000video\ue001"
PLACES = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}


def view(inputs: tuple[str, ...] = ("text", "image", "video"), places: Any = PLACES) -> Any:
    media = SimpleNamespace(chat_placeholders=places) if places is not None else None
    return SimpleNamespace(name="vl", inputs=inputs, media=media)


def render(v: Any, messages: list[dict[str, Any]], template: str = QWEN2_VL) -> str:
    typed = chat_media.typed_messages(v, messages)
    text = ChatTemplate(template, {}).render(typed, True)
    return chat_media.restore_sentinels(v, text, messages)


def test_media_come_back_marked_where_the_template_places_them() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Look: {IMAGE} then {VIDEO}. Which?"},
    ]
    assert render(view(), messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\nLook: {IMAGE} then {VIDEO}. Which?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_typed_parts_keep_text_around_each_medium() -> None:
    typed = chat_media.typed_messages(view(), [{"role": "user", "content": f"a{IMAGE}b"}])
    assert typed[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image", "image": ""},
        {"type": "text", "text": "b"},
    ]


@pytest.mark.parametrize(
    ("v", "content", "kind", "says"),
    [
        (view(("text",), None), f"{IMAGE}hi", "unsupported-media", "takes no image"),
        (view(("text", "image"), {"image": PLACES["image"]}), VIDEO, "unsupported-media", "video"),
        (view(), "stray \ue000 mark", "invalid", "U+E000"),
    ],
)
def test_media_the_model_cannot_take_are_refused(
    v: Any, content: str, kind: str, says: str
) -> None:
    with pytest.raises(HostFailure) as refused:
        render(v, [{"role": "user", "content": content}])
    assert refused.value.kind == kind and says in str(refused.value)


def test_a_template_with_no_place_for_media_is_refused() -> None:
    plain = "{% for m in messages %}{{ m['content'] is string }}{% endfor %}"
    with pytest.raises(HostFailure) as refused:
        render(view(), [{"role": "user", "content": f"{IMAGE}hi"}], plain)
    assert refused.value.kind == "invalid" and "placed 0 of" in str(refused.value)
