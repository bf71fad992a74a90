"""The torch driver's KV pool on the CPU is not written at start: its memory becomes resident
as passes use pages, and each page is zeroed the first time a pass names it, so its unwritten
slots hold zeros as in a pool zeroed at once."""

from __future__ import annotations

import pytest
import torch

from pie.drivers.kvcache import KvCacheShape, PagedKvCache

pytestmark = pytest.mark.unit

SHAPE = KvCacheShape(num_layers=4, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_large_pool_costs_no_resident_memory_until_pages_are_used() -> None:
    before = _resident_bytes()
    cache = PagedKvCache(SHAPE, 8192, "cpu", zero_on_first_use=True)  # 256 MiB
    grown = _resident_bytes() - before
    cache.prepare(range(64))
    used = _resident_bytes() - before
    assert cache.kv.numel() * 4 == 8192 * SHAPE.bytes_per_page
    assert grown < 16 << 20, grown
    assert used >= grown + 64 * SHAPE.bytes_per_page // 2


def test_a_page_is_zeroed_the_first_time_only() -> None:
    cache = PagedKvCache(SHAPE, 8, "cpu", zero_on_first_use=True)
    cache.kv.fill_(float("nan"))
    cache.prepare([2, 5, 2])
    assert torch.equal(cache.kv[:, [2, 5]], torch.zeros_like(cache.kv[:, [2, 5]]))
    assert cache.kv[:, [0, 1, 3, 4, 6, 7]].isnan().all()
    cache.kv[:, 2].fill_(1.0)  # a pass wrote it
    cache.prepare([2])
    assert (cache.kv[:, 2] == 1.0).all()


def test_an_eager_pool_is_zero_from_the_start() -> None:
    cache = PagedKvCache(SHAPE, 8, "cpu")
    assert torch.count_nonzero(cache.kv) == 0
    cache.kv.fill_(3.0)
    cache.prepare([1])
    assert (cache.kv == 3.0).all()
