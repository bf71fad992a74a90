"""The kv core contract run by KvCore."""

from __future__ import annotations

import pytest

from pie.actors.kv import KvCore
from tests.contracts.kv import KvCoreContract
from tests.contracts.kv_invariants import MakeCore

pytestmark = pytest.mark.unit


class TestKvCore(KvCoreContract):
    @pytest.fixture
    def make_core(self) -> MakeCore:
        return KvCore
