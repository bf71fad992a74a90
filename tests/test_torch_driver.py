"""TorchDriver on a tiny stand-in model: chunking, batching, page copies and masks change
nothing but what they should (logits within 1e-5), and bad batches leave the cache alone."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from pie.drivers.base import DriverError
from pie.drivers.batch import ForwardBatch
from pie.drivers.models.base import AttentionFn, CausalLM, ModelConfig
from pie.drivers.torch_driver import TorchDriver
from pie.events.forward import ForwardRequest, PageCopy
from pie.events.sampling import (
    Argmax,
    LogitsOutput,
    Multinomial,
    RawLogits,
    Rle,
    SamplingSlot,
    SlotOp,
    SlotOutput,
    rle_to_bools,
)

pytestmark = pytest.mark.unit

TOL = 1e-5
DEVICE = os.environ.get("PIE_TEST_DEVICE", "cpu")
PAGE = 4
VOCAB = 50
CONFIG = ModelConfig(
    model_type="tiny",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    rope_scaling=None,
    tie_word_embeddings=False,
    attention_bias=True,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_ids=(0,),
    raw={},
)


class TinyLM(CausalLM):
    """Embedding plus position embedding, layers of qkv -> attention -> out proj (residual)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        qkv_width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.qkv = nn.ModuleList(nn.Linear(c.hidden_size, qkv_width) for _ in range(c.num_layers))
        self.out = nn.ModuleList(
            nn.Linear(c.num_heads * c.head_dim, c.hidden_size) for _ in range(c.num_layers)
        )
        self.head = nn.Linear(c.hidden_size, c.vocab_size)

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        c, t = self.config, input_ids.shape[0]
        x = self.embed(input_ids) + self.position(positions)
        sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        for layer in range(c.num_layers):
            q, k, v = self.qkv[layer](x).split(sizes, dim=-1)
            out = attention(
                layer,
                q.view(t, c.num_heads, c.head_dim),
                k.view(t, c.num_kv_heads, c.head_dim),
                v.view(t, c.num_kv_heads, c.head_dim),
            )
            x = x + self.out[layer](out.reshape(t, -1))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


@pytest.fixture(scope="module")
def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(CONFIG).eval().to(DEVICE)


def make_driver(model: TinyLM, num_pages: int = 32) -> TorchDriver:
    return TorchDriver(
        model,
        CONFIG,
        page_size=PAGE,
        num_pages=num_pages,
        max_batch_tokens=256,
        max_batch_requests=16,
        device=DEVICE,
        dtype=torch.float32,
        model_name="tiny",
        seed=0,
    )


def request(
    done: int,
    tokens: Sequence[int],
    pages: Sequence[int],
    ops: Sequence[SlotOp] = (RawLogits(),),
    **extra: object,
) -> ForwardRequest:
    """`tokens` appended after `done` tokens of a context; every op reads the last token."""
    n = len(tokens)
    return ForwardRequest(
        corr=0,
        requester="test",
        context=0,
        tokens=tuple(tokens),
        positions=tuple(range(done, done + n)),
        kv_start=done,
        pages=tuple(pages),
        slots=tuple(SamplingSlot(index=n - 1, op=op) for op in ops),
        **extra,  # type: ignore[arg-type]
    )


def pages_for(count: int, pool: Sequence[int]) -> tuple[int, ...]:
    return tuple(pool[: -(-count // PAGE)])


def logits_of(output: SlotOutput) -> torch.Tensor:
    assert isinstance(output, LogitsOutput)
    return torch.tensor(output.values)


def dense_logits(model: TinyLM, tokens: Sequence[int], visible: torch.Tensor) -> torch.Tensor:
    """All-token logits of one sequence in one pass, token i attending where visible[i]."""

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", q, kk) / q.shape[-1] ** 0.5
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num()
        return torch.einsum("hij,jhd->ihd", weights, vv)

    ids, positions = torch.tensor(tokens, device=DEVICE), torch.arange(len(tokens), device=DEVICE)
    visible = visible.to(DEVICE)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, attention)).cpu()


SEQUENCE = [7, 3, 41, 8, 8, 19, 2, 33, 25, 4, 11]
POOL = [9, 2, 17, 5, 30, 12]


def test_prefill_in_one_pass_matches_one_token_per_pass(model: TinyLM) -> None:
    pages = pages_for(len(SEQUENCE), POOL)
    whole = make_driver(model).forward(ForwardBatch.from_requests([request(0, SEQUENCE, pages)]))
    stepwise = make_driver(model)
    for i, token in enumerate(SEQUENCE):
        last = stepwise.forward(ForwardBatch.from_requests([request(i, [token], pages)]))
    torch.testing.assert_close(logits_of(whole[0]), logits_of(last[0]), atol=TOL, rtol=TOL)
    causal = torch.ones(len(SEQUENCE), len(SEQUENCE), dtype=torch.bool).tril()
    dense = dense_logits(model, SEQUENCE, causal)[-1]
    torch.testing.assert_close(logits_of(whole[0]), dense, atol=TOL, rtol=TOL)


def contexts() -> list[tuple[list[int], int, list[int]]]:
    """(prompt, tokens already in the cache before the batch, page pool) per context."""
    rng = random.Random(3)
    pools = [[0, 7, 3, 22], [1, 13, 6], [4, 19, 2, 28, 11], [5, 8]]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 5, 14, 3)]
    return list(zip(prompts, (6, 0, 10, 2), pools, strict=True))


def batch_requests(ops: Sequence[SlotOp]) -> tuple[list[ForwardRequest], list[ForwardRequest]]:
    """Per context, the warm-up request and the request the compared batch carries."""
    warm, step = [], []
    for prompt, done, pool in contexts():
        pages = pages_for(len(prompt), pool)
        warm.append(request(0, prompt[:done], pages) if done else None)
        step.append(request(done, prompt[done:], pages, ops))
    return [w for w in warm if w is not None], step


def test_batch_matches_each_request_alone(model: TinyLM) -> None:
    ops: list[SlotOp] = [RawLogits(), Argmax(), Multinomial(seed=5)]
    warm, step = batch_requests(ops)
    together = make_driver(model)
    together.forward(ForwardBatch.from_requests(warm))
    batched = together.forward(ForwardBatch.from_requests(step))
    alone = make_driver(model)
    for w in warm:
        alone.forward(ForwardBatch.from_requests([w]))
    single = [out for s in step for out in alone.forward(ForwardBatch.from_requests([s]))]
    assert len(batched) == len(single) == 3 * len(step)
    for got, want in zip(batched, single, strict=True):
        if isinstance(want, LogitsOutput):
            torch.testing.assert_close(logits_of(got), logits_of(want), atol=TOL, rtol=TOL)
        else:
            assert got == want


def test_copied_page_gives_fork_the_same_continuation(model: TinyLM) -> None:
    prefix, (x, y) = SEQUENCE[:6], (12, 40)
    driver = make_driver(model)
    driver.forward(ForwardBatch.from_requests([request(0, prefix, (3, 8))]))
    original = request(6, [x], (3, 8))
    fork = request(6, [x], (3, 21), copies=(PageCopy(src=8, dst=21),))
    a, b = driver.forward(ForwardBatch.from_requests([original, fork]))
    torch.testing.assert_close(logits_of(a), logits_of(b), atol=TOL, rtol=TOL)
    [forked_next] = driver.forward(ForwardBatch.from_requests([request(7, [y], (3, 21))]))
    fresh = make_driver(model)
    fresh.forward(ForwardBatch.from_requests([request(0, [*prefix, x], (0, 1))]))
    [fresh_next] = fresh.forward(ForwardBatch.from_requests([request(7, [y], (0, 1))]))
    torch.testing.assert_close(logits_of(forked_next), logits_of(fresh_next), atol=TOL, rtol=TOL)


def dense_visibility(masked_pages: tuple[int, ...], masks: tuple[Rle, ...] | None) -> torch.Tensor:
    """[11, 11]: an 8-token causal prompt, then 3 tokens under the given masks."""
    visible = torch.ones(11, 11, dtype=torch.bool).tril()
    for t in range(3):
        row = 8 + t
        if masks is not None:
            bits = rle_to_bools(masks[t], sum(masks[t]))
            visible[row, : len(bits)] &= torch.tensor(bits)
        for page in masked_pages:
            visible[row, page * PAGE : (page + 1) * PAGE] = False
    return visible


@pytest.mark.parametrize(
    "masked_pages,masks",
    [
        ((0,), None),
        ((), ((5, 2, 2), (1, 3, 6), (0, 4, 7))),
        ((1,), ((3, 2, 4), (0, 2, 8), (11,))),
        ((0, 1, 2), ((9,), (10,), (11,))),
    ],
)
def test_masks_match_the_dense_reference(
    model: TinyLM, masked_pages: tuple[int, ...], masks: tuple[Rle, ...] | None
) -> None:
    pages = (14, 6, 27)
    driver = make_driver(model)
    driver.forward(ForwardBatch.from_requests([request(0, SEQUENCE[:8], pages)]))
    step = ForwardRequest(
        corr=0,
        requester="test",
        context=0,
        tokens=tuple(SEQUENCE[8:]),
        positions=(8, 9, 10),
        kv_start=8,
        pages=pages,
        masked_pages=masked_pages,
        attention_masks=masks,
        slots=tuple(SamplingSlot(index=i, op=RawLogits()) for i in range(3)),
    )
    outputs = driver.forward(ForwardBatch.from_requests([step]))
    dense = dense_logits(model, SEQUENCE, dense_visibility(masked_pages, masks))[8:]
    plain = dense_logits(model, SEQUENCE, torch.ones(11, 11, dtype=torch.bool).tril())[8:]
    for i, out in enumerate(outputs):
        torch.testing.assert_close(logits_of(out), dense[i], atol=TOL, rtol=TOL)
    assert not torch.allclose(dense, plain, atol=1e-3)


Mutation = Callable[[ForwardBatch], object]


def _set(name: str, index: int, value: object) -> Mutation:
    return lambda b: getattr(b, name).__setitem__(index, value)


MALFORMED: dict[str, tuple[Mutation, str]] = {
    "page out of range": (_set("kv_page_indices", 1, 32), "request 0 names a page"),
    "positions mismatch": (lambda b: b.positions.pop(), "positions"),
    "kv_len below new tokens": (_set("kv_lens", 1, 1), "request 1 has kv_len 1"),
    "too few pages": (_set("kv_lens", 0, 13), "request 0 has 2 pages"),
    "mask runs off": (_set("attention_masks", 1, ((2, 1), (9,))), "request 1 attention mask"),
    "slot reads another request": (_set("slot_tokens", 0, 5), "slot 0 of request 0"),
    "logit mask length": (_set("logit_masks", 0, (10, 39)), "request 0 logit mask"),
    "token out of vocab": (_set("token_ids", 0, VOCAB), "request 0 has a token id"),
    "masked page index": (_set("masked_pages", 1, (4,)), "request 1 masks a page"),
    "copy out of range": (_set("copies", 0, (2, 99)), "page copy 2 -> 99"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=str)
def test_malformed_batch_raises_and_leaves_the_cache_alone(model: TinyLM, case: str) -> None:
    mutate, message = MALFORMED[case]
    driver = make_driver(model)
    driver.forward(ForwardBatch.from_requests([request(0, SEQUENCE[:5], (2, 9))]))
    driver.cache.kv.normal_()
    before = driver.cache.kv.clone()
    batch = ForwardBatch.from_requests(
        [
            request(5, SEQUENCE[5:8], (2, 9), copies=(PageCopy(src=9, dst=4),)),
            request(0, [1, 2], (11,), attention_masks=((1,), (2,))),
        ]
    )
    mutate(batch)
    with pytest.raises(DriverError, match=message):
        driver.forward(batch)
    assert torch.equal(driver.cache.kv, before)


def test_statistics_count_passes_and_tokens(model: TinyLM) -> None:
    driver = make_driver(model)
    driver.forward(ForwardBatch.from_requests([request(0, SEQUENCE[:4], (0,))]))
    driver.forward(ForwardBatch.from_requests([request(4, SEQUENCE[4:5], (0, 1))]))
    stats = driver.statistics()
    assert (stats.passes, stats.tokens) == (2, 5)
    assert 0 < stats.last_pass_seconds <= stats.total_seconds


def test_pages_for_budget_uses_the_model_shape() -> None:
    per_page = 2 * 2 * PAGE * 2 * 8 * 2
    pages = TorchDriver.pages_for_budget(
        CONFIG, budget_bytes=100 * per_page + 5, page_size=PAGE, dtype=torch.bfloat16
    )
    assert pages == 100


def test_garbage_in_pages_no_pass_has_used_never_reaches_the_logits(model: TinyLM) -> None:
    """The CPU pool is not zeroed at start: whatever its memory held (NaN here) must not leak
    into a batch whose padded attention reads the unwritten slots of its pages."""
    clean, dirty = make_driver(model), make_driver(model)
    dirty.cache.kv.fill_(float("nan"))
    warm, step = batch_requests([RawLogits()])
    for driver in (clean, dirty):
        driver.forward(ForwardBatch.from_requests(warm))
    want = clean.forward(ForwardBatch.from_requests(step))
    got = dirty.forward(ForwardBatch.from_requests(step))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(logits_of(a), logits_of(b), atol=0.0, rtol=0.0)
