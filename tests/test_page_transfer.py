"""Whole KV pages read out as bytes and written into other pages (a named snapshot copied
between nodes): the torch cache in float32, bfloat16 and int8 (its scales with it), and the
synthetic driver's stand-in pages."""

from __future__ import annotations

import pytest
import torch

from pie.drivers.kvcache import KvCacheShape, PagedKvCache
from pie.drivers.kvcache_int8 import Int8PagedKvCache
from pie.drivers.page_transfer import CachePages
from pie.drivers.synthetic import SyntheticDriver

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def cache(dtype: torch.dtype, seed: int, device: str = "cpu") -> PagedKvCache:
    shape = KvCacheShape(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    torch.manual_seed(seed)
    if dtype == torch.int8:
        made: PagedKvCache = Int8PagedKvCache(shape, 10, device, value_dtype=torch.float32)
        made.kv.copy_(torch.randint(-127, 128, made.kv.shape, dtype=torch.int8))
        made.scales.copy_(torch.rand(made.scales.shape))  # type: ignore[attr-defined]
    else:
        made = PagedKvCache(shape, 10, device)
        made.kv.copy_(torch.randn(made.kv.shape).to(dtype))
    return made


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("devices", [("cpu", "cpu"), *((d, "cuda") for d in DEVICES[1:])])
def test_pages_read_out_land_in_other_pages_of_another_cache_unchanged(
    dtype: torch.dtype, devices: tuple[str, str]
) -> None:
    """Also from a CPU node to a GPU node and between GPUs where there is one."""
    source, target = cache(dtype, 1, devices[0]), cache(dtype, 2, devices[1])
    out, into = CachePages(source, "m"), CachePages(target, "m")
    data = out.export_pages([3, 1, 7])
    into.import_pages([0, 5, 2], data)
    assert out.layout == into.layout and len(data) == 3 * out.page_bytes
    assert out.page_bytes == source.shape.bytes_per_page
    assert torch.equal(target.kv[:, [0, 5, 2]].cpu(), source.kv[:, [3, 1, 7]].cpu())
    untouched = cache(dtype, 2, devices[1]).kv[:, 4]
    assert torch.equal(target.kv[:, 4], untouched), "other pages untouched"
    if dtype == torch.int8:
        got = target.scales[:, [0, 5, 2]].cpu()  # type: ignore[attr-defined]
        assert torch.equal(got, source.scales[:, [3, 1, 7]].cpu())  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not 2 pages"):
        into.import_pages([0, 1], data)
    with pytest.raises(ValueError, match="outside 0..9"):
        out.export_pages([10])


@pytest.mark.unit
def test_the_synthetic_driver_keeps_the_pages_it_is_given() -> None:
    pages = SyntheticDriver(num_pages=8).page_transfer()
    data = bytes(range(32))
    pages.import_pages([2, 5], data)
    assert pages.export_pages([5, 2, 0]) == data[16:] + data[:16] + bytes(16)
    with pytest.raises(ValueError, match="outside 0..7"):
        pages.import_pages([8], bytes(16))
