"""How a batch is split for the paged kernels (decode, causal and custom-mask groups in
flashinfer's CSR form), how a decode group is padded for a CUDA graph, which bucket it
replays, and which driver the engine picks on a machine without a GPU."""

from __future__ import annotations

import pytest

from pie.config import EngineConfig, with_overrides
from pie.drivers.batch import ForwardBatch
from pie.drivers.cuda_graphs import graph_buckets
from pie.drivers.paged_plan import GroupKind, bucket_for, padded_decode, plan_attention
from pie.drivers.select import choose_driver
from pie.events.forward import ForwardRequest
from pie.events.sampling import Argmax, SamplingSlot, bools_to_rle

pytestmark = pytest.mark.unit

PAGE = 4


def _request(start: int, n: int, pages: tuple[int, ...], **fields: object) -> ForwardRequest:
    return ForwardRequest(
        corr=0,
        requester="t",
        context=0,
        tokens=tuple(range(1, n + 1)),
        positions=tuple(range(start, start + n)),
        kv_start=start,
        pages=pages,
        slots=(SamplingSlot(index=n - 1, op=Argmax()),),
        **fields,  # type: ignore[arg-type]
    )


def test_a_decode_pass_is_one_group_over_the_whole_batch() -> None:
    batch = ForwardBatch.from_requests([_request(5, 1, (7, 3)), _request(0, 1, (9, 2))])
    plan = plan_attention(batch, PAGE)
    [group] = plan.groups
    assert plan.is_decode_only and group.is_whole(2)
    assert (group.kv_indptr, group.kv_indices, group.last_page_len) == (
        [0, 2, 3],
        [7, 3, 9],
        [2, 1],
    )
    assert plan.write_rows == (3 * 2 * PAGE + 1, 9 * 2 * PAGE + 0)


def test_a_mixed_pass_splits_into_groups_that_keep_their_tokens() -> None:
    masks = (bools_to_rle([True, False, True]), bools_to_rle([True, False, True, True]))
    batch = ForwardBatch.from_requests(
        [
            _request(0, 3, (4,)),
            _request(6, 1, (5, 6)),
            _request(2, 2, (8,), attention_masks=masks),
        ]
    )
    kinds = {g.kind: g for g in plan_attention(batch, PAGE).groups}
    assert kinds[GroupKind.CAUSAL].tokens == [0, 1, 2]
    assert kinds[GroupKind.DECODE].tokens == [3]
    custom = kinds[GroupKind.CUSTOM]
    assert custom.tokens == [4, 5]
    assert custom.flat_mask().tolist() == [True, False, True, False, True, False, True, True]
    assert custom.blind == []


def test_masked_pages_before_the_new_tokens_are_left_out() -> None:
    batch = ForwardBatch.from_requests([_request(9, 1, (1, 2, 3), masked_pages=(0, 1))])
    [group] = plan_attention(batch, PAGE).groups
    assert group.kind is GroupKind.DECODE
    assert (group.kv_indices, group.last_page_len) == ([3], [2])


def test_a_masked_page_under_the_new_token_needs_an_explicit_mask() -> None:
    batch = ForwardBatch.from_requests([_request(4, 1, (1, 2), masked_pages=(1,))])
    [group] = plan_attention(batch, PAGE).groups
    assert group.kind is GroupKind.CUSTOM
    assert group.flat_mask().tolist() == [True] * 4 + [False]
    blind = ForwardBatch.from_requests([_request(0, 1, (1,), masked_pages=(0,))])
    assert plan_attention(blind, PAGE).groups[0].blind == [0]


def test_a_graph_pads_a_decode_group_onto_the_scratch_page() -> None:
    batch = ForwardBatch.from_requests([_request(5, 1, (7, 3))])
    [group] = plan_attention(batch, PAGE).groups
    assert padded_decode(group, 3, scratch_page=64) == ([0, 2, 3, 4], [7, 3, 64, 64], [2, 1, 1])


def test_buckets_cover_every_pass_up_to_the_largest() -> None:
    assert graph_buckets((), 20) == (1, 2, 4, 8, 12, 16, 20)
    assert graph_buckets((3, 300), 64) == (3, 64)
    assert [bucket_for(n, (1, 4, 8)) for n in (1, 3, 8, 9)] == [1, 4, 8, None]
    with pytest.raises(ValueError, match=">= 1"):
        graph_buckets((0,), 8)


def test_without_a_gpu_the_torch_driver_runs_and_says_why() -> None:
    choice = choose_driver(EngineConfig())
    assert (choice.driver, choice.device) == ("torch", "cpu")
    assert "not a CUDA GPU" in choice.reason and "float32" in choice.reason
    forced = with_overrides(EngineConfig(), driver={"backend": "cuda"})
    with pytest.raises(RuntimeError, match="backend = cuda cannot run: the device is cpu"):
        choose_driver(forced)
