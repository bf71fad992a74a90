"""PagedAttention against a dense reference that gathers each request's K/V slot by slot and
applies the visibility rules with plain loops; fp32 outputs agree within 1e-5."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pie.drivers.attention import PagedAttention, rle_rows
from pie.drivers.batch import ForwardBatch
from pie.drivers.kvcache import KvCacheShape, PagedKvCache, pages_for_budget
from pie.drivers.models.base import PLAIN_ATTENTION, LayerAttention
from pie.events.forward import ForwardRequest
from pie.events.sampling import Rle, bools_to_rle, rle_to_bools

pytestmark = pytest.mark.unit

TOL = 1e-5
DEVICE = os.environ.get("PIE_TEST_DEVICE", "cpu")
PAGE = 4
NUM_PAGES = 64


def make_cache(heads_kv: int, dim: int, layers: int = 2) -> PagedKvCache:
    shape = KvCacheShape(
        num_layers=layers, page_size=PAGE, num_kv_heads=heads_kv, head_dim=dim, dtype=torch.float32
    )
    cache = PagedKvCache(shape, NUM_PAGES, DEVICE)
    cache.kv.normal_()
    return cache


def make_request(
    rng: random.Random,
    free: list[int],
    n: int,
    kv_len: int,
    *,
    masks: tuple[Rle, ...] | None = None,
    masked_pages: tuple[int, ...] = (),
) -> ForwardRequest:
    """A request whose pages are drawn at random from `free` (non-contiguous, any order)."""
    count = -(-kv_len // PAGE) + rng.randint(0, 1)
    pages = tuple(free.pop(rng.randrange(len(free))) for _ in range(count))
    return ForwardRequest(
        corr=0,
        requester="test",
        context=0,
        tokens=(0,) * n,
        positions=tuple(range(kv_len - n, kv_len)),
        kv_start=kv_len - n,
        pages=pages,
        masked_pages=masked_pages,
        attention_masks=masks,
    )


def random_masks(rng: random.Random, n: int, kv_len: int) -> tuple[Rle, ...]:
    """Per token a random mask over [0, s+1) or over all kv_len slots."""
    masks = []
    for t in range(n):
        length = rng.choice((kv_len - n + t + 1, kv_len))
        masks.append(bools_to_rle([rng.random() < 0.6 for _ in range(length)]))
    return tuple(masks)


def visible(req: ForwardRequest, t: int, window: int | None = None) -> list[bool]:
    s = req.kv_len - len(req.tokens) + t
    seen = [j <= s and (window is None or s - j < window) for j in range(req.kv_len)]
    if req.attention_masks is not None:
        bits = rle_to_bools(req.attention_masks[t], sum(req.attention_masks[t]))
        seen = [ok and j < len(bits) and bits[j] for j, ok in enumerate(seen)]
    return [ok and j // PAGE not in req.masked_pages for j, ok in enumerate(seen)]


def dense_reference(
    pages_before: torch.Tensor,
    requests: list[ForwardRequest],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: LayerAttention = PLAIN_ATTENTION,
) -> torch.Tensor:
    """Softmax attention in float64 over explicitly gathered slots; blind tokens give zeros."""
    out = torch.zeros_like(q, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    start = 0
    for req in requests:
        n = len(req.tokens)
        keys = [pages_before[req.pages[j // PAGE], 0, j % PAGE] for j in range(req.kv_len)]
        values = [pages_before[req.pages[j // PAGE], 1, j % PAGE] for j in range(req.kv_len)]
        kk, vv = torch.stack(keys).double(), torch.stack(values).double()
        kk[req.kv_len - n :] = k[start : start + n].double()
        vv[req.kv_len - n :] = v[start : start + n].double()
        kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
        for t in range(n):
            seen = torch.tensor(visible(req, t, spec.sliding_window))
            if not seen.any():
                continue
            scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
            scores = torch.einsum("hd,jhd->hj", q[start + t].double(), kk) * scale
            if spec.softcap is not None:
                scores = torch.tanh(scores / spec.softcap) * spec.softcap
            weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            out[start + t] = torch.einsum("hj,jhd->hd", weights, vv)
        start += n
    return out


def run_case(
    requests: list[ForwardRequest],
    heads: int,
    heads_kv: int,
    dim: int = 8,
    layers: tuple[LayerAttention, ...] = (),
) -> None:
    cache = make_cache(heads_kv, dim, layers=max(2, len(layers)))
    batch = ForwardBatch.from_requests(requests)
    attention = PagedAttention(batch, cache, layers)
    for layer in range(max(2, len(layers))):
        spec = layers[layer] if layers else PLAIN_ATTENTION
        before = cache.layer(layer).clone().cpu()
        t = batch.num_tokens
        q, k, v = (
            torch.randn(t, heads, dim),
            torch.randn(t, heads_kv, dim),
            torch.randn(t, heads_kv, dim),
        )
        out = attention(layer, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)).cpu()
        expected = dense_reference(before, requests, q, k, v, spec)
        torch.testing.assert_close(out.double(), expected, atol=TOL, rtol=TOL)
        assert_written(cache, layer, before, requests, k, v)


def assert_written(
    cache: PagedKvCache,
    layer: int,
    before: torch.Tensor,
    requests: list[ForwardRequest],
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """New K/V sit at their slots; every other slot of the layer is unchanged."""
    expected = before.clone()
    start = 0
    for req in requests:
        n = len(req.tokens)
        for t in range(n):
            slot = req.kv_len - n + t
            expected[req.pages[slot // PAGE], 0, slot % PAGE] = k[start + t]
            expected[req.pages[slot // PAGE], 1, slot % PAGE] = v[start + t]
        start += n
    assert torch.equal(cache.layer(layer).cpu(), expected)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (6, 2)])
def test_decode_only_batch_matches_dense(seed: int, heads: int, heads_kv: int) -> None:
    rng = random.Random(seed)
    free = list(range(NUM_PAGES))
    requests = [make_request(rng, free, 1, kv_len) for kv_len in (1, 4, 7, 16, 33, 50)]
    run_case(requests, heads, heads_kv)


@pytest.mark.parametrize("seed", range(3))
def test_mixed_prefill_and_decode_batch_matches_dense(seed: int) -> None:
    rng = random.Random(seed)
    free = list(range(NUM_PAGES))
    shapes = [(1, 9), (5, 5), (1, 30), (12, 20), (3, 11), (3, 3), (1, 1)]
    requests = [make_request(rng, free, n, kv_len) for n, kv_len in shapes]
    run_case(requests, heads=6, heads_kv=2)


@pytest.mark.parametrize("seed", range(3))
def test_custom_masks_match_dense(seed: int) -> None:
    rng = random.Random(seed)
    free = list(range(NUM_PAGES))
    shapes = [(1, 13), (6, 18), (1, 7), (4, 4)]
    requests = [
        make_request(rng, free, n, kv_len, masks=random_masks(rng, n, kv_len))
        for n, kv_len in shapes
    ]
    requests.append(make_request(rng, free, 2, 10))
    run_case(requests, heads=6, heads_kv=2)


@pytest.mark.parametrize("seed", range(3))
def test_masked_pages_are_invisible(seed: int) -> None:
    rng = random.Random(seed)
    free = list(range(NUM_PAGES))
    requests = [
        make_request(rng, free, 1, 17, masked_pages=(0, 2)),
        make_request(rng, free, 5, 14, masked_pages=(1,)),
        make_request(rng, free, 3, 9, masks=random_masks(rng, 3, 9), masked_pages=(0,)),
        make_request(rng, free, 1, 6),
    ]
    run_case(requests, heads=4, heads_kv=2)


MODEL_LAYERS = (
    LayerAttention(sliding_window=5),
    LayerAttention(softcap=2.0, scale=0.7),
    LayerAttention(sliding_window=9, softcap=3.0),
    PLAIN_ATTENTION,
)
"""Per-layer options as Gemma and Mistral use them: windows shorter and longer than some
requests, soft-capped scores (a low cap, so that it bites on these random scores), a scale."""


@pytest.mark.parametrize("seed", range(3))
def test_sliding_windows_softcaps_and_scales_match_dense(seed: int) -> None:
    rng = random.Random(seed)
    free = list(range(NUM_PAGES))
    shapes = [(1, 3), (1, 17), (6, 6), (12, 20), (3, 11), (1, 40)]
    requests = [make_request(rng, free, n, kv_len) for n, kv_len in shapes]
    requests.append(make_request(rng, free, 4, 15, masks=random_masks(rng, 4, 15)))
    requests.append(make_request(rng, free, 1, 21, masked_pages=(3,)))
    run_case(requests, heads=6, heads_kv=2, layers=MODEL_LAYERS)


@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (6, 2)])
def test_windows_on_fresh_prefills_and_decodes_alone(heads: int, heads_kv: int) -> None:
    """The paths that skip building a mask: one fresh prefill (SDPA's causal flag), and a
    decode-only batch (query heads folded onto their kv head)."""
    for shapes in ([(14, 14), (14, 14)], [(1, 30), (1, 8)]):
        rng = random.Random(0)
        free = list(range(NUM_PAGES))
        requests = [make_request(rng, free, n, kv_len) for n, kv_len in shapes]
        run_case(requests, heads=heads, heads_kv=heads_kv, layers=MODEL_LAYERS)


def test_token_that_sees_nothing_outputs_zeros() -> None:
    rng = random.Random(0)
    free = list(range(NUM_PAGES))
    blind_mask = ((0, 5), (0, 7), (2, 5))
    requests = [
        make_request(rng, free, 1, 5, masked_pages=(0, 1)),
        make_request(rng, free, 3, 7, masks=blind_mask),
    ]
    run_case(requests, heads=4, heads_kv=2)
    cache = make_cache(2, 8)
    out = PagedAttention(ForwardBatch.from_requests(requests), cache)(
        0, *(torch.randn(4, heads, 8, device=DEVICE) for heads in (4, 2, 2))
    ).cpu()
    assert not out.isnan().any()
    assert torch.equal(out[:3], torch.zeros(3, 4, 8))


def test_rle_rows_expands_and_pads() -> None:
    rows = rle_rows([(2, 1, 1), (0, 3), (5,)], 6)
    assert rows.tolist() == [
        [True, True, False, True, False, False],
        [False, False, False, False, False, False],
        [True, True, True, True, True, False],
    ]


def test_page_copies_reach_every_layer() -> None:
    cache = make_cache(2, 8, layers=3)
    before = cache.kv.clone()
    cache.copy_pages(torch.tensor([3, 5], device=DEVICE), torch.tensor([5, 9], device=DEVICE))
    assert torch.equal(cache.kv[:, 5], before[:, 3])
    assert torch.equal(cache.kv[:, 9], before[:, 5])
    assert torch.equal(cache.kv[:, 3], before[:, 3])


def test_pages_for_budget_counts_whole_pages() -> None:
    shape = KvCacheShape(
        num_layers=30, page_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16
    )
    assert shape.bytes_per_page == 30 * 2 * 16 * 3 * 64 * 2
    assert pages_for_budget(10 * shape.bytes_per_page + 1, shape) == 10
    with pytest.raises(ValueError):
        pages_for_budget(shape.bytes_per_page - 1, shape)
