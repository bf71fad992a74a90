"""The driver contract run by the synthetic driver, and by the torch driver on a tiny random Qwen3
whose logits are checked against transformers on the same weights."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from pie.drivers.loader import LoadedModel, load_model
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.torch_driver import TorchDriver
from tests.contracts.driver import DriverContract
from tests.contracts.driver_chaining import ChainingContract
from tests.contracts.passes import NewDriver, Reference
from tests.tiny_models import TINY_CASES, TINY_TOLERANCE, save_tiny_model
from tests.tiny_models import reference_logits as transformers_logits

pytestmark = pytest.mark.integration

DEVICE = os.environ.get("PIE_TEST_DEVICE", "cpu")
PAGE = 4
LIMITS = dict(page_size=PAGE, num_pages=64, max_batch_tokens=24, max_batch_requests=6)


class TestSyntheticDriver(DriverContract):
    computes_model = False
    reference_tolerance = 0.0
    logit_tolerance = 0.0

    vocab_size: ClassVar[int] = 64

    @pytest.fixture
    def new_driver(self) -> NewDriver:
        return lambda: SyntheticDriver(vocab_size=self.vocab_size, **LIMITS)

    @pytest.fixture
    def reference_logits(self) -> Reference:
        """Its documented model: a logit of 1 for token t + 1 after token t, 0 for the rest."""

        def one_hot(tokens: Sequence[int]) -> torch.Tensor:
            following = (torch.tensor(tokens) + 1) % self.vocab_size
            return torch.nn.functional.one_hot(following, self.vocab_size).double()

        return one_hot


class TestTorchDriver(DriverContract, ChainingContract):
    """On a tiny random Qwen3 (GQA, q/k norm) against transformers; a subclass that sets
    `device` runs the same contract on another torch device."""

    computes_model = True
    reference_tolerance = TINY_TOLERANCE
    logit_tolerance = 1e-5

    device: ClassVar[str] = DEVICE

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_qwen3(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
        """A tiny random Qwen3 checkpoint folder and the transformers model it was saved from."""
        folder = tmp_path_factory.mktemp("tiny-qwen3")
        return folder, save_tiny_model(folder, TINY_CASES["qwen3-qk-norm-wide-heads"])

    @pytest.fixture(scope="class")
    @classmethod
    def loaded(cls, tiny_qwen3: tuple[Path, torch.nn.Module]) -> LoadedModel:
        return load_model(str(tiny_qwen3[0]), torch.float32, cls.device)

    @pytest.fixture
    def new_driver(self, loaded: LoadedModel) -> NewDriver:
        def build() -> TorchDriver:
            return TorchDriver(
                loaded.model,
                loaded.config,
                device=self.device,
                dtype=torch.float32,
                model_name="tiny-qwen3",
                seed=0,
                **LIMITS,
            )

        return build

    @pytest.fixture
    def reference_logits(self, tiny_qwen3: tuple[Path, torch.nn.Module]) -> Reference:
        return lambda tokens: transformers_logits(tiny_qwen3[1], torch.tensor(tokens))
