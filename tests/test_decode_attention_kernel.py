"""The CPU decode attention kernel that reads KV pages in place: the op (each instruction-set
variant) against a float64 softmax over explicitly gathered slots, and PagedAttention with it
against the gather path on a mixed batch; fp32 results agree within 1e-5."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pie.drivers import decode_attention
from pie.drivers.attention import PagedAttention
from pie.drivers.batch import ForwardBatch
from pie.drivers.decode_attention import reads_in_place
from pie.drivers.kernels import KernelBuildError, kernel_ops
from pie.drivers.kvcache import KvCacheShape, PagedKvCache
from pie.drivers.kvcache_int8 import Int8PagedKvCache
from pie.drivers.models.base import PLAIN_ATTENTION, LayerAttention
from pie.events.sampling import bools_to_rle
from tests.kernel_variants import VARIANTS
from tests.test_paged_attention import make_request

pytestmark = pytest.mark.unit

TOL = 1e-5
CONTEXTS = (1, 17, 300, 0)
"""Each op case's requests; the last one sees nothing (no slot at all)."""
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "window": {"window": 20},
    "softcap and scale": {"softcap": 2.0, "scale": 0.3},
    "visible": {"visible": True},
    "all of them": {"window": 40, "softcap": 5.0, "scale": 0.2, "visible": True},
}


def _pool(pages: int, page_size: int, heads_kv: int, dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(pages, 2, page_size, heads_kv, dim, generator=generator)


def _tables(lens: list[int], page_size: int, num_pages: int, rng: random.Random) -> torch.Tensor:
    """Each request's pages drawn at random from the pool, with a spare page at the end of some
    and page-0 padding up to the widest."""
    free = list(range(num_pages))
    rng.shuffle(free)
    rows = [[free.pop() for _ in range(-(-n // page_size) + rng.randint(0, 1))] for n in lens]
    width = max(len(row) for row in rows) + 1
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long)


def _visible(lens: list[int], rng: random.Random) -> torch.Tensor:
    """Random visibility, with the second request's slots all hidden (it sees nothing)."""
    width = max(lens) + 3
    visible = torch.tensor([[rng.random() < 0.7 for _ in range(width)] for _ in lens])
    visible[1] = False
    return visible


def reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
    visible: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention in float64 over each request's slots gathered explicitly."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    page_size, group = pool.shape[2], q.shape[1] // pool.shape[3]
    for b, length in enumerate(lens.tolist()):
        slots = torch.arange(length)
        pages, offsets = table[b, slots // page_size], slots % page_size
        seen = slots >= length - window if window else torch.ones(length, dtype=torch.bool)
        if visible is not None:
            seen &= visible[b, :length]
        if not seen.any():
            continue
        k = pool[pages, 0, offsets].double().repeat_interleave(group, 1)
        v = pool[pages, 1, offsets].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,jhd->hj", q[b].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[b] = torch.einsum("hj,jhd->hd", weights, v)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("heads,heads_kv", [(9, 3), (4, 4)])
@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize("option", OPTIONS)
def test_op_matches_a_float64_softmax_over_gathered_slots(
    variant: str, heads: int, heads_kv: int, page_size: int, option: str
) -> None:
    ops = kernel_ops("attention", variant)
    if variant != "native":
        assert ops.isa() == variant
    rng = random.Random(heads * page_size)
    chosen: dict[str, Any] = OPTIONS[option]
    num_pages = 2 * sum(-(-n // page_size) + 1 for n in CONTEXTS)
    pool = _pool(num_pages, page_size, heads_kv, 64, seed=page_size)
    lens = torch.tensor(CONTEXTS, dtype=torch.long)
    table = _tables(list(CONTEXTS), page_size, num_pages, rng)
    q = torch.randn(len(CONTEXTS), heads, 64)
    scale, softcap = chosen.get("scale", 64**-0.5), chosen.get("softcap", 0.0)
    window = chosen.get("window", 0)
    visible = _visible(list(CONTEXTS), rng) if chosen.get("visible") else None

    out = ops.decode(q, pool, table, lens, scale, softcap, window, visible)

    expected = reference(q, pool, table, lens, scale, softcap, window, visible)
    torch.testing.assert_close(out.double(), expected, atol=TOL, rtol=TOL)
    assert torch.equal(out[-1], torch.zeros(heads, 64))
    if visible is not None:
        assert torch.equal(out[1], torch.zeros(heads, 64))


def _case(heads: int, heads_kv: int, dim: int, lens: list[int], seed: int) -> tuple[Any, ...]:
    """q, pool, table, kv_lens and visible for requests of the given lengths, page size 16."""
    rng = random.Random(seed)
    num_pages = 2 * sum(-(-n // 16) + 1 for n in lens)
    table = _tables(lens, 16, num_pages, rng)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(seed))
    visible = _visible(lens, rng)
    visible[1] = True
    pool = _pool(num_pages, 16, heads_kv, dim, seed=seed)
    return q, pool, table, torch.tensor(lens), visible


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dim", [36, 128])
def test_op_takes_head_sizes_off_and_on_the_vector_width(variant: str, dim: int) -> None:
    """36 ends in a part vector on every build; 128 is one of the specialised sizes."""
    q, pool, table, lens, visible = _case(6, 2, dim, [5, 40, 77], seed=dim)
    out = kernel_ops("attention", variant).decode(q, pool, table, lens, 0.2, 3.0, 50, visible)
    expected = reference(q, pool, table, lens, 0.2, 3.0, 50, visible)
    torch.testing.assert_close(out.double(), expected, atol=TOL, rtol=TOL)


def test_op_splits_a_requests_kv_heads_over_threads() -> None:
    """With more threads than requests, each request's kv heads are shared out (3 over 2)."""
    q, pool, table, lens, visible = _case(9, 3, 64, [130, 0], seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = kernel_ops("attention").decode(q[:1], pool, table[:1], lens[:1], 0.1, 0.0, 0, None)
    finally:
        torch.set_num_threads(threads)
    expected = reference(q[:1], pool, table[:1], lens[:1], 0.1, 0.0, 0, None)
    torch.testing.assert_close(out.double(), expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    "table,lens,message",
    [
        ([[0, 7]], [20], "not a page of the 4-page pool"),
        ([[0, -1]], [17], "not a page of the 4-page pool"),
        ([[0, 1]], [33], "does not fit 2 pages of 16 slots"),
    ],
)
def test_op_refuses_slots_outside_the_pool(
    table: list[list[int]], lens: list[int], message: str
) -> None:
    ops = kernel_ops("attention")
    pool = _pool(4, 16, 1, 8, seed=0)
    with pytest.raises(RuntimeError, match=message):
        ops.decode(
            torch.randn(1, 2, 8),
            pool,
            torch.tensor(table),
            torch.tensor(lens),
            1.0,
            0.0,
            0,
            None,
        )


PAGE = 4
LAYERS = (
    PLAIN_ATTENTION,
    LayerAttention(sliding_window=6),
    LayerAttention(softcap=2.0, scale=0.3),
    LayerAttention(sliding_window=25, softcap=4.0),
)


def _mixed_batch(rng: random.Random) -> ForwardBatch:
    """Decodes of several lengths (one with masked pages, one with its own mask, one that sees
    nothing) beside a prefill."""
    free = list(range(1, 80))
    mask = bools_to_rle([rng.random() < 0.6 for _ in range(23)])
    return ForwardBatch.from_requests(
        [
            make_request(rng, free, 1, 1),
            make_request(rng, free, 1, 9),
            make_request(rng, free, 5, 12),
            make_request(rng, free, 1, 70, masked_pages=(0, 3, 7)),
            make_request(rng, free, 1, 23, masks=(mask,)),
            make_request(rng, free, 1, 8, masked_pages=(0, 1)),
            make_request(rng, free, 1, 33),
        ]
    )


def _cache() -> PagedKvCache:
    shape = KvCacheShape(
        num_layers=len(LAYERS), page_size=PAGE, num_kv_heads=3, head_dim=64, dtype=torch.float32
    )
    cache = PagedKvCache(shape, 80, "cpu")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(1)))
    return cache


def _gathered_rows(cache: PagedKvCache) -> list[int]:
    """Records how many rows each `gather` on this cache reads."""
    counts: list[int] = []
    gather = cache.gather

    def counting(layer: int, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        counts.append(rows.numel())
        return gather(layer, rows, out)

    cache.gather = counting  # type: ignore[method-assign]
    return counts


def test_paged_attention_with_the_kernel_matches_the_gather_path() -> None:
    batch = _mixed_batch(random.Random(0))
    kernel_cache, gather_cache = _cache(), _cache()
    gathered = _gathered_rows(kernel_cache)
    with_kernel = PagedAttention(batch, kernel_cache, LAYERS)
    with_gather = PagedAttention(batch, gather_cache, LAYERS, in_place_decode=False)
    generator = torch.Generator().manual_seed(2)
    for layer in range(len(LAYERS)):
        q, k, v = (torch.randn(batch.num_tokens, h, 64, generator=generator) for h in (9, 3, 3))
        out = with_kernel(layer, q, k, v)
        torch.testing.assert_close(out, with_gather(layer, q, k, v), atol=TOL, rtol=TOL)
        assert torch.equal(out[batch.qo_indptr[5]], torch.zeros(9, 64))
    assert torch.equal(kernel_cache.kv, gather_cache.kv)
    # Only the prefill (kv_len 12) gathers: its K and V in every layer.
    assert gathered == [12, 12] * len(LAYERS)


def test_int8_pages_keep_the_gather() -> None:
    shape = KvCacheShape(
        num_layers=1, page_size=PAGE, num_kv_heads=3, head_dim=64, dtype=torch.int8
    )
    assert not reads_in_place(Int8PagedKvCache(shape, 4, "cpu", value_dtype=torch.float32))
    assert reads_in_place(_cache())


def test_a_kernel_that_does_not_build_falls_back_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing(library: str) -> Any:
        raise KernelBuildError("no compiler here")

    monkeypatch.setattr(decode_attention, "kernel_ops", missing)
    decode_attention._kernel.cache_clear()
    try:
        assert not reads_in_place(_cache())
        assert not reads_in_place(_cache())
    finally:
        decode_attention._kernel.cache_clear()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["pie: no compiler here; decode attention gathers the KV pages instead"]
