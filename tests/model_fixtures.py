"""Shared model fixtures: the default model converted once per checkout. Use them with
`pytest_plugins = ("model_fixtures",)` or by importing the fixture names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pie.drivers.loader.resolve import default_gguf_path, resolve_model
from pie.drivers.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def default_model_dir(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The default SmolLM2 GGUF converted into an HF-style folder, cached inside pytest's cache
    folder so it is reused across runs and never lands in $HOME (per session when pytest's cache
    is disabled). The folder lies at <cache>/models/<key>."""
    cache = getattr(pytestconfig, "cache", None)
    cache_dir = (
        tmp_path_factory.mktemp("pie-models") if cache is None else cache.mkdir("pie-models")
    )
    return resolve_model(None, cache_dir=cache_dir)


def components_dir(pytestconfig: pytest.Config) -> str:
    """Where engines in tests keep compiled components: pytest's cache folder, or the engine's
    own default when pytest's cache is disabled."""
    cache = getattr(pytestconfig, "cache", None)
    return "" if cache is None else str(cache.mkdir("pie-components"))


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    """The default model's tokenizer."""
    return Tokenizer.from_folder(default_model_dir)


def real_model(
    default_model_dir: Path, pytestconfig: pytest.Config, num_pages: int
) -> tuple[Any, Any, Any]:
    """(config, torch driver, tokenizer) for engines on the real default model, float32 on the
    CPU, with `num_pages` KV pages; compiled components stay in pytest's cache."""
    from pie.config import EngineConfig, with_overrides
    from pie.drivers.factory import build_torch_driver

    config = with_overrides(
        EngineConfig(),
        model={"path": str(default_model_dir), "dtype": "float32", "device": "cpu"},
        kv={"num_pages": num_pages},
        sandbox={"cache_dir": components_dir(pytestconfig)},
    )
    driver, tokenizer = build_torch_driver(config)
    return config, driver, tokenizer


@pytest.fixture(scope="module")
def real(default_model_dir: Path, pytestconfig: pytest.Config) -> tuple[Any, Any, Any]:
    """The real default model with 256 KV pages (see `real_model`)."""
    return real_model(default_model_dir, pytestconfig, num_pages=256)
