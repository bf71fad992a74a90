"""The int8 KV cache: pages stored as int8 with a float32 scale per page, K or V, and head,
against the same passes on a float32 cache; its rescaling, copies and sizing; and the real
model reading a text back through it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pie.drivers.attention import PagedAttention
from pie.drivers.batch import ForwardBatch
from pie.drivers.kvcache import KvCacheShape, PagedKvCache, pages_for_budget
from pie.drivers.kvcache_int8 import Int8PagedKvCache
from pie.drivers.loader import LoadedModel, load_model
from pie.events.forward import ForwardRequest

pytest_plugins = ("model_fixtures",)

PAGE = 4


def _shape(dtype: torch.dtype, layers: int = 2, heads: int = 2, dim: int = 8) -> KvCacheShape:
    return KvCacheShape(
        num_layers=layers, page_size=PAGE, num_kv_heads=heads, head_dim=dim, dtype=dtype
    )


def _int8(shape: KvCacheShape, pages: int, lazy: bool = False) -> Int8PagedKvCache:
    return Int8PagedKvCache(shape, pages, "cpu", value_dtype=torch.float32, lazy=lazy)


def _request(pages: tuple[int, ...], n: int, kv_len: int) -> ForwardRequest:
    return ForwardRequest(
        corr=0,
        requester="test",
        context=0,
        tokens=(0,) * n,
        positions=tuple(range(kv_len - n, kv_len)),
        kv_start=kv_len - n,
        pages=pages,
        masked_pages=(),
    )


@pytest.mark.unit
def test_int8_pages_attend_like_float32_pages_pass_after_pass() -> None:
    """Two prefills then decode steps whose keys grow larger every step (so pages rescale):
    attention over int8 pages stays within 0.05 of float32 pages on unit-scale values."""
    rng = random.Random(0)
    torch.manual_seed(0)
    reference = PagedKvCache(_shape(torch.float32), 64, "cpu")
    quantized = _int8(_shape(torch.int8), 64)
    free = list(range(64))
    lengths = [20, 9]
    pages = [[free.pop(rng.randrange(len(free))) for _ in range(-(-n // PAGE))] for n in lengths]
    new_tokens = list(lengths)
    for step in range(6):
        batch = ForwardBatch.from_requests(
            [_request(tuple(p), n, kv) for p, n, kv in zip(pages, new_tokens, lengths, strict=True)]
        )
        ours, theirs = PagedAttention(batch, quantized), PagedAttention(batch, reference)
        for layer in range(2):
            t = batch.num_tokens
            q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8) * (1 + step), torch.randn(t, 2, 8)
            assert (ours(layer, q, k, v) - theirs(layer, q, k, v)).abs().max() < 0.05
        for i, p in enumerate(pages):
            if lengths[i] % PAGE == 0:
                p.append(free.pop())
            lengths[i] += 1
        new_tokens = [1, 1]


@pytest.mark.unit
def test_a_page_rescales_when_larger_values_arrive() -> None:
    """A small token then a large one in the same page: both read back within one step of the
    page's final scale, and the scale is the large token's absmax / 127 per head."""
    cache = _int8(_shape(torch.int8, layers=1), 4)
    small, large = torch.randn(1, 2, 8) * 0.01, torch.randn(1, 2, 8) * 10
    rows = torch.tensor([2 * PAGE + 0, 2 * PAGE + 1])  # page 1, slots 0 and 1
    cache.write(0, rows[:1], small, small)
    cache.write(0, rows[1:], large, large)
    out = torch.empty(2, 2, 8)
    got = cache.gather(0, rows, out)
    scale = cache.scales[0, 1, 0]
    assert torch.allclose(scale, large.abs().amax(-1)[0] / 127)
    assert ((got - torch.cat([small, large])).abs() <= scale[None, :, None]).all()
    assert torch.count_nonzero(cache.scales[0, [0, 2, 3]]) == 0


@pytest.mark.unit
def test_page_copies_carry_scales_and_fresh_pages_start_at_zero() -> None:
    cache = _int8(_shape(torch.int8), 6, lazy=True)
    cache.prepare([1, 2])
    assert torch.count_nonzero(cache.kv) == 0 and torch.count_nonzero(cache.scales) == 0
    assert cache.used_pages == 3
    cache.write(1, torch.tensor([1 * 2 * PAGE]), torch.ones(1, 2, 8), torch.ones(1, 2, 8) * 3)
    cache.copy_pages(torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(cache.scales[:, 2], cache.scales[:, 1])
    assert torch.equal(cache.kv[:, 2], cache.kv[:, 1])
    row = torch.tensor([2 * 2 * PAGE])
    assert torch.allclose(cache.gather(1, row, torch.empty(1, 2, 8)), torch.ones(1, 2, 8))


@pytest.mark.unit
def test_an_int8_page_costs_a_quarter_of_float32_plus_its_scales() -> None:
    fp32, int8 = _shape(torch.float32), _shape(torch.int8)
    values = 2 * 2 * PAGE * 2 * 8
    assert fp32.bytes_per_page == values * 4
    assert int8.bytes_per_page == values + 2 * 2 * 2 * 4
    assert pages_for_budget(1 << 20, int8) > 3.5 * pages_for_budget(1 << 20, fp32)


@pytest.fixture(scope="module")
def smollm2(default_model_dir: Path) -> LoadedModel:
    return load_model(str(default_model_dir), torch.float32, "cpu")


@pytest.mark.model
def test_the_real_model_reads_text_back_through_int8_pages_nearly_as_through_float32(
    smollm2: LoadedModel,
) -> None:
    """300 tokens of prose, teacher-forced a page per pass so every pass reads earlier pages
    back: the share of positions whose likeliest next token agrees (printed, measured 0.97)
    and the mean log-probability of the text (measured -4.704 float32, -4.708 int8)."""
    model, config = smollm2.model, smollm2.config
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    ids = smollm2.tokenizer.encode(text[:1500])[:300]
    shape = KvCacheShape(
        num_layers=config.num_layers,
        page_size=16,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=torch.float32,
    )
    fp32 = _read_back(model, ids, PagedKvCache(shape, 32, "cpu"))
    int8_shape = KvCacheShape(**{**_fields(shape), "dtype": torch.int8})
    int8 = _read_back(
        model, ids, Int8PagedKvCache(int8_shape, 32, "cpu", value_dtype=torch.float32)
    )
    agreement = float((fp32.argmax(-1) == int8.argmax(-1)).float().mean())
    targets = torch.tensor(ids[1:])[:, None]
    logprob = [float(torch.log_softmax(x[:-1], -1).gather(1, targets).mean()) for x in (fp32, int8)]
    print(f"int8 KV: argmax agreement {agreement:.3f}; mean logprob {logprob} (float32, int8)")
    assert agreement > 0.93
    assert abs(logprob[0] - logprob[1]) < 0.03


def _fields(shape: KvCacheShape) -> dict[str, Any]:
    return {
        "num_layers": shape.num_layers,
        "page_size": shape.page_size,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
    }


def _read_back(model: Any, ids: list[int], cache: PagedKvCache) -> torch.Tensor:
    logits = []
    for start in range(0, len(ids), 16):
        chunk = ids[start : start + 16]
        end = start + len(chunk)
        request = ForwardRequest(
            corr=0,
            requester="test",
            context=0,
            tokens=tuple(chunk),
            positions=tuple(range(start, end)),
            kv_start=start,
            pages=tuple(range(-(-end // 16))),
            masked_pages=(),
        )
        attention = PagedAttention(ForwardBatch.from_requests([request]), cache)
        with torch.inference_mode():
            hidden = model(torch.tensor(chunk), torch.arange(start, end), attention)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


@pytest.mark.unit
def test_the_int8_kv_cache_is_refused_off_the_torch_driver_before_any_model_loads() -> None:
    from pie.config import EngineConfig, with_overrides
    from pie.drivers import factory
    from pie.drivers.select import DriverChoice

    config = with_overrides(EngineConfig(), model={"path": "/no/such/model"}, kv={"dtype": "int8"})
    cuda = DriverChoice(driver="cuda", device="cuda", dtype=torch.bfloat16, reason="")
    with pytest.raises(ValueError, match="torch driver only"):
        factory._build(config, cuda)
