"""The torch driver's KV pool on the CPU is a fresh anonymous map nothing writes at start: its
memory becomes resident as passes write pages, and unwritten slots read as zeros, as in a pool
zeroed at once. The pool's default size comes from the model and
the memory free, and the engine reports where its resident memory goes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pie.config import EngineConfig, with_overrides
from pie.drivers import factory
from pie.drivers.batch import ForwardBatch
from pie.drivers.kvcache import KvCacheShape, PagedKvCache
from pie.drivers.memory import memory_use
from pie.drivers.select import DriverChoice
from pie.drivers.torch_driver import TorchDriver
from pie.events.forward import ForwardRequest
from tests.tiny_models import TINY_CASES, save_tiny_model

pytestmark = pytest.mark.unit

SHAPE = KvCacheShape(num_layers=4, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)


def _resident_bytes() -> int:
    """Exact: the kernel walks the page tables for smaps_rollup (statm's counters may lag)."""
    with open("/proc/self/smaps_rollup") as rollup:
        line = next(line for line in rollup if line.startswith("Rss:"))
    return int(line.split()[1]) * 1024


def test_a_large_pool_costs_no_resident_memory_until_pages_are_used() -> None:
    before = _resident_bytes()
    cache = PagedKvCache(SHAPE, 8192, "cpu", lazy=True)  # 256 MiB
    grown = _resident_bytes() - before
    cache.kv[:, :64].fill_(1.0)  # passes wrote 64 pages
    used = _resident_bytes() - before
    assert cache.kv.numel() * 4 == 8192 * SHAPE.bytes_per_page
    assert grown < 16 << 20, grown
    assert used >= grown + 64 * SHAPE.bytes_per_page // 2


def test_a_lazy_pool_reads_as_zeros_and_counts_the_pages_passes_name() -> None:
    cache = PagedKvCache(SHAPE, 8, "cpu", lazy=True)
    assert torch.count_nonzero(cache.kv) == 0 and cache.used_pages == 1
    cache.prepare([2, 5, 2])
    cache.kv[:, 2].fill_(1.0)  # a pass wrote it
    cache.prepare([2])
    assert (cache.kv[:, 2] == 1.0).all() and cache.used_pages == 3


def test_padding_never_reads_unwritten_memory() -> None:
    """Two decodes of different lengths pad their gathers with page 0, under a zero weight:
    whatever other pages hold (NaN here), the outputs are finite."""
    from pie.drivers.attention import PagedAttention

    cache = PagedKvCache(SHAPE, 8, "cpu", lazy=True)
    assert cache.used_pages == 1 and torch.count_nonzero(cache.kv[:, 0]) == 0
    cache.kv[:, 1:].fill_(float("nan"))
    cache.kv[:, [3, 4, 6]] = torch.randn_like(cache.kv[:, [3, 4, 6]])  # the contexts' own pages
    requests = [
        ForwardRequest(
            corr=1,
            requester="t",
            context=1,
            tokens=(0,),
            positions=(n - 1,),
            kv_start=n - 1,
            pages=pages,
            masked_pages=(),
        )
        for n, pages in ((20, (3, 4)), (3, (6,)))
    ]
    batch = ForwardBatch.from_requests(requests)
    cache.prepare(batch.kv_page_indices)
    attention = PagedAttention(batch, cache)
    out = attention(0, torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64))
    assert torch.isfinite(out).all()


def test_an_eager_pool_is_zero_from_the_start() -> None:
    cache = PagedKvCache(SHAPE, 8, "cpu")
    assert torch.count_nonzero(cache.kv) == 0
    cache.kv.fill_(3.0)
    cache.prepare([1])
    assert (cache.kv == 3.0).all()


def _pool_pages(monkeypatch: pytest.MonkeyPatch, free_mb: int, **kv: int) -> int:
    """The pool size the factory picks for the tiny Llama shape (2 layers, 2 kv heads of 16,
    256 positions) with `free_mb` of memory free."""
    from pie.drivers.loader.config import model_config_from_hf

    monkeypatch.setattr(factory, "_free_memory", lambda device: free_mb << 20)
    raw = {
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    config = with_overrides(EngineConfig(), kv={"page_size": 16, **kv})
    choice = DriverChoice(driver="torch", device="cpu", dtype=torch.float32, reason="")
    return factory._pages_for(config, model_config_from_hf(raw), choice)


def test_the_default_pool_holds_full_contexts_for_a_whole_batch_within_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    per_page = 2 * 2 * 16 * 2 * 16 * 4  # layers, K and V, slots, kv heads, head_dim, float32
    full_batch = EngineConfig().scheduler.max_batch_requests * 256 // 16
    assert _pool_pages(monkeypatch, free_mb=64 << 10) == full_batch
    assert _pool_pages(monkeypatch, free_mb=1) == (1 << 20) // 2 // per_page
    assert _pool_pages(monkeypatch, free_mb=64 << 10, memory_mb=1) == (1 << 20) // per_page


def test_memory_use_splits_resident_memory_into_model_kv_and_the_rest(tmp_path: Path) -> None:
    from pie.drivers.loader import load_model

    save_tiny_model(tmp_path, TINY_CASES["llama-linear-rope-tied"])
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    driver = TorchDriver(
        loaded.model,
        loaded.config,
        page_size=16,
        num_pages=64,
        max_batch_tokens=256,
        max_batch_requests=8,
        device="cpu",
        dtype=torch.float32,
        model_name="tiny",
    )
    params = {p.data_ptr(): p.numel() * 4 for p in loaded.model.parameters()}
    rope = sum(b.numel() * 4 for b in loaded.model.buffers())
    before = memory_use(driver)
    request = ForwardRequest(
        corr=1,
        requester="t",
        context=1,
        tokens=tuple(range(40)),
        positions=tuple(range(40)),
        kv_start=0,
        pages=(0, 1, 2),
        masked_pages=(),
    )
    driver.forward(ForwardBatch.from_requests([request]))
    after = memory_use(driver)
    page_mb = driver.cache.bytes_per_page / (1 << 20)
    assert before.model * (1 << 20) == sum(params.values()) + rope  # tied head counted once
    # Page 0 is zeroed at start: batches pad their gathers with it.
    assert before.kv_used == pytest.approx(page_mb) and after.kv_used == pytest.approx(3 * page_mb)
    assert after.kv_pool == pytest.approx(64 * page_mb)
    assert after.resident == pytest.approx(after.model + after.kv_used + after.other)
    assert after.on_device == "cpu"
