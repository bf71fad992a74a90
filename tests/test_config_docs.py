"""docs/config.md opens with every key of every section and its default, as TOML: the block
parses, holds exactly the keys the config classes have, and its values are their defaults."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs
import pytest

from pie.config import EngineConfig

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
DESCRIBED_BELOW = {"mcp": {"servers"}}
"""Tables of tables, which the document describes after the block."""
ARRAYS_BELOW = {"models"}
"""Arrays of tables ([[models]] takes [model]'s keys), described after the block."""


def documented() -> dict[str, Any]:
    text = DOC.read_text()
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    return tomllib.loads(block)


def defaults(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in attrs.fields(type(section))}


def test_every_section_and_key_is_documented_with_its_default() -> None:
    doc, config = documented(), EngineConfig()
    assert set(doc) == {f.name for f in attrs.fields(EngineConfig)} - ARRAYS_BELOW
    for name, keys in doc.items():
        actual = defaults(getattr(config, name))
        expected = set(actual) - DESCRIBED_BELOW.get(name, set())
        assert set(keys) == expected, name
        for key, value in keys.items():
            default = actual[key]
            if isinstance(default, tuple):
                default = list(default)
            if isinstance(default, dict) or attrs.has(type(default)):
                continue
            assert value == default, f"[{name}] {key}: documented {value!r}, default {default!r}"
