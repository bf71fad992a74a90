"""LoRA adapters without the engine: the torch driver's logits for one batch that mixes
adapters and the base model against peft's, loading refused with the file and key named, the
kv core keeping each adapter's KV to itself, and the fast path's lanes keeping to their lease's
adapter."""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pie.actors.kv import KvCore
from pie.cli.options import engine_config
from pie.config import ConfigError, config_from_dict
from pie.dataplane.lanes import Lanes
from pie.drivers.base import DriverError
from pie.drivers.batch import ForwardBatch
from pie.drivers.loader import load_model
from pie.drivers.lora import LoraLinear, load_adapters
from pie.drivers.quantize import Int8Linear, quantize_int8
from pie.drivers.torch_driver import TorchDriver
from pie.events import kv as ev
from pie.events.batching import ScheduleForward
from pie.events.forward import ForwardRequest
from pie.events.sampling import Argmax, LogitsOutput, RawLogits, SamplingSlot, TokenOutput
from pie.events.speculation import Lease
from tests.tiny_adapters import ADAPTERS, peft_logits, peft_model, save_tiny_adapters
from tests.tiny_models import TINY_TOLERANCE, save_tiny_model

pytestmark = pytest.mark.unit

PAGE = 4
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 64, 9, 30]
CHOICES: list[str | None] = [None, *ADAPTERS]
"""The base model, then every adapter."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny random Llama, its adapters, and peft serving them all."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(root / "base", dict(model_type="llama"))
    folders = save_tiny_adapters(base, root)
    return SimpleNamespace(folder=root / "base", folders=folders, peft=peft_model(base, folders))


def new_driver(tiny: SimpleNamespace, *, int8: bool = False) -> TorchDriver:
    loaded = load_model(str(tiny.folder), torch.float32, "cpu")
    adapters = load_adapters(loaded.model, tiny.folders, max_adapters=8, rank_budget=64)
    if int8:
        quantize_int8(loaded.model)
    return TorchDriver(
        loaded.model,
        loaded.config,
        page_size=PAGE,
        num_pages=64,
        max_batch_tokens=256,
        max_batch_requests=8,
        device="cpu",
        dtype=torch.float32,
        model_name="tiny",
        seed=0,
        adapters=adapters,
    )


def prefill(r: int, adapter: str | None, tokens: list[int] = PROMPT) -> ForwardRequest:
    """Request r: `tokens` from the start of its own pages, logits read at every position."""
    return ForwardRequest(
        corr=r,
        requester="test",
        context=r,
        tokens=tuple(tokens),
        positions=tuple(range(len(tokens))),
        kv_start=0,
        pages=tuple(range(8 * r, 8 * r + 8)),
        slots=tuple(SamplingSlot(index=i, op=RawLogits()) for i in range(len(tokens))),
        adapter=adapter,
    )


def logits(outputs: list[Any]) -> torch.Tensor:
    assert all(isinstance(out, LogitsOutput) for out in outputs)
    return torch.tensor([out.values for out in outputs])


def test_one_batch_mixing_adapters_and_the_base_model_matches_peft(tiny: Any) -> None:
    driver = new_driver(tiny)
    batch = ForwardBatch.from_requests([prefill(r, a) for r, a in enumerate(CHOICES)])

    outputs = driver.forward(batch)

    n = len(PROMPT)
    for r, adapter in enumerate(CHOICES):
        ours, theirs = logits(outputs[r * n : (r + 1) * n]), peft_logits(tiny.peft, adapter, PROMPT)
        assert (ours - theirs).abs().max().item() <= TINY_TOLERANCE, adapter
        if adapter is not None:
            base = peft_logits(tiny.peft, None, PROMPT)
            assert (theirs - base).abs().max().item() > 1.0, "the update must show"


def test_a_batch_all_through_one_adapter_matches_peft(tiny: Any) -> None:
    driver = new_driver(tiny)

    outputs = driver.forward(ForwardBatch.from_requests([prefill(0, "verbose")]))

    theirs = peft_logits(tiny.peft, "verbose", PROMPT)
    assert (logits(outputs) - theirs).abs().max().item() <= TINY_TOLERANCE


def test_lane_decodes_run_through_the_adapter_they_carry(tiny: Any) -> None:
    driver = new_driver(tiny)
    driver.forward(ForwardBatch.from_requests([prefill(r, a) for r, a in enumerate(CHOICES)]))
    following = 77
    batch = ForwardBatch()
    for r, adapter in enumerate(CHOICES):
        pages = tuple(range(8 * r, 8 * r + 4))
        batch.add_decode(following, len(PROMPT), pages, len(PROMPT) + 1, (), RawLogits(), adapter)

    outputs = driver.forward(batch)

    for r, adapter in enumerate(CHOICES):
        theirs = peft_logits(tiny.peft, adapter, [*PROMPT, following])[-1]
        assert (logits([outputs[r]])[0] - theirs).abs().max().item() <= TINY_TOLERANCE


def test_a_batch_naming_an_adapter_not_loaded_is_refused_before_it_runs(tiny: Any) -> None:
    driver = new_driver(tiny)
    batch = ForwardBatch.from_requests([prefill(0, None), prefill(1, "nope")])

    with pytest.raises(DriverError, match="request 1 names adapter 'nope'"):
        driver.forward(batch)
    assert driver.statistics().passes == 0


INT8_TOLERANCE = 0.5
"""int8 rows against peft's float32 on the tiny model (measured: 0.03 for this token); the
update moves these logits by 2.9, so an update lost in the conversion fails."""


def test_int8_weights_keep_the_adapters(tiny: Any) -> None:
    driver = new_driver(tiny, int8=True)

    [out] = driver.forward(ForwardBatch.from_requests([prefill(0, "terse", PROMPT[:1])]))

    wrapped = [m for m in driver.model.modules() if isinstance(m, LoraLinear)]
    assert wrapped and all(isinstance(m.base, Int8Linear) for m in wrapped)
    theirs = peft_logits(tiny.peft, "terse", PROMPT[:1])[0]
    assert (logits([out])[0] - theirs).abs().max().item() <= INT8_TOLERANCE


# -- loading: what is refused, and how it is said -----------------------------------------------


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(folder: Path, edit: Any) -> None:
    path = folder / "adapter_model.safetensors"
    weights = load_file(path)
    edit(weights)
    save_file(weights, path)


A_PROJ = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
BROKEN: dict[str, tuple[Any, str]] = {
    "no config": (
        lambda f: (f / "adapter_config.json").unlink(),
        "adapter_config.json: no such file",
    ),
    "no weights": (
        lambda f: (f / "adapter_model.safetensors").unlink(),
        "adapter_model.safetensors: no such file",
    ),
    "not lora": (lambda f: edit_config(f, peft_type="IA3"), "peft_type 'IA3' is not supported"),
    "bias": (lambda f: edit_config(f, bias="all"), "bias = 'all' is not supported"),
    "saved modules": (
        lambda f: edit_config(f, modules_to_save=["lm_head"]),
        "adapter_config.json: modules_to_save = ['lm_head'] is not supported",
    ),
    "dora": (lambda f: edit_config(f, use_dora=True), "use_dora = True is not supported"),
    "rank patterns": (
        lambda f: edit_config(f, rank_pattern={"q_proj": 2}),
        "rank_pattern = {'q_proj': 2} is not supported",
    ),
    "bad rank": (lambda f: edit_config(f, r=0), "r must be a positive integer, got 0"),
    "missing target": (
        lambda f: edit_config(f, target_modules=["q_proj", "embed_tokens"]),
        "target_modules 'embed_tokens' matches no linear layer",
    ),
    "rank mismatch": (
        lambda f: edit_config(f, r=5),
        "and r = 5 need (5, ",
    ),
    "foreign weight": (
        lambda f: edit_weights(
            f, lambda w: w.update({"base_model.model.lm_head.lora_embedding_A": w[A_PROJ].clone()})
        ),
        "unsupported weight 'base_model.model.lm_head.lora_embedding_A'",
    ),
    "unpaired": (
        lambda f: edit_weights(f, lambda w: w.pop(A_PROJ.replace("lora_A", "lora_B"))),
        "model.layers.0.self_attn.q_proj has lora_A without its pair",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_malformed_adapter_folder_is_refused_naming_the_file_and_key(
    tiny: Any, tmp_path: Path, case: str
) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(tiny.folders["terse"], folder)
    breaks, says = BROKEN[case]
    breaks(folder)
    loaded = load_model(str(tiny.folder), torch.float32, "cpu")

    with pytest.raises(ValueError) as refused:
        load_adapters(loaded.model, {"broken": folder}, max_adapters=8, rank_budget=64)

    assert str(folder) in str(refused.value) and says in str(refused.value)


def test_the_adapter_count_and_their_ranks_added_up_are_bounded(tiny: Any) -> None:
    model = load_model(str(tiny.folder), torch.float32, "cpu").model

    with pytest.raises(ValueError, match="3 adapters configured; .* max_adapters allows 2"):
        load_adapters(model, tiny.folders, max_adapters=2, rank_budget=64)
    with pytest.raises(ValueError, match="ranks add up to 14; .* adapter_rank_budget allows 12"):
        load_adapters(model, tiny.folders, max_adapters=8, rank_budget=12)


def test_adapters_come_from_the_config_file_and_the_command_line() -> None:
    config = config_from_dict({"model": {"adapters": {"sql": "/a/sql"}}})
    args = argparse.Namespace(
        config=None, model=None, dtype=None, device=None, adapter=["chat=/a/chat"]
    )

    assert config.model.adapters == {"sql": "/a/sql"}
    assert engine_config(args).model.adapters == {"chat": "/a/chat"}
    with pytest.raises(ConfigError, match="'two words' is not an adapter name"):
        config_from_dict({"model": {"adapters": {"two words": "/a"}}})
    with pytest.raises(ValueError, match="--adapter wants NAME=PATH"):
        engine_config(argparse.Namespace(**{**vars(args), "adapter": ["/a/chat"]}))


# -- the kv core: adapters salt the prefix cache ------------------------------------------------


class Kv:
    def __init__(self) -> None:
        self.core = KvCore(
            num_pages=32, page_size=PAGE, vocab_size=100, prefix_cache="global", adapters=ADAPTERS
        )
        self._corr = itertools.count(1)

    def send(self, make: Any, **fields: Any) -> Any:
        [(_, reply)] = self.core.handle(make(corr=next(self._corr), requester="a", **fields))
        return reply

    def create(self) -> int:
        return int(self.send(ev.CreateContext).context)

    def submit(self, context: int, tokens: list[int], **fields: Any) -> Any:
        reply = self.send(ev.SubmitForward, context=context, tokens=tuple(tokens), **fields)
        return reply.request if isinstance(reply, ScheduleForward) else reply

    def write(self, context: int, tokens: list[int], adapter: str | None = None) -> Any:
        request = self.submit(context, tokens, adapter=adapter)
        self.core.handle(ev.PassApplied(corr=request.corr, context=context))
        return request


TOKENS = list(range(1, 10))
"""Two full pages and one token more: the prefix cache can offer the two pages."""


def test_kv_written_under_one_adapter_serves_only_that_adapter() -> None:
    kv = Kv()
    kv.write(kv.create(), TOKENS)
    kv.write(kv.create(), TOKENS, adapter="terse")

    sparse = kv.submit(kv.create(), TOKENS, adapter="sparse")
    terse = kv.submit(kv.create(), TOKENS, adapter="terse")
    base = kv.submit(kv.create(), TOKENS)

    assert sparse.kv_start == 0 and sparse.adapter == "sparse"
    assert terse.kv_start == 2 * PAGE and terse.adapter == "terse"
    assert base.kv_start == 2 * PAGE and base.adapter is None


def test_a_context_that_changes_adapter_shares_nothing_written_after_the_change() -> None:
    kv = Kv()
    mixed = kv.create()
    kv.write(mixed, TOKENS[:4])
    kv.write(mixed, TOKENS[4:], adapter="terse")

    # The first page was written under the base model, the second under the adapter.
    assert kv.submit(kv.create(), TOKENS).kv_start == PAGE
    assert kv.submit(kv.create(), TOKENS, adapter="terse").kv_start == 0


def test_a_failed_pass_through_an_adapter_leaves_the_context_under_the_base_model() -> None:
    kv = Kv()
    context = kv.create()
    failed = kv.submit(context, TOKENS[:4], adapter="terse")
    kv.core.handle(ev.PassApplied(corr=failed.corr, context=context, ok=False))
    kv.write(context, TOKENS[:8])

    assert kv.submit(kv.create(), TOKENS).kv_start == 2 * PAGE


def test_an_unknown_adapter_is_refused_and_the_next_pass_is_served() -> None:
    kv = Kv()
    context = kv.create()

    refused = kv.submit(context, TOKENS, adapter="missing")
    served = kv.submit(context, TOKENS, adapter="terse")

    assert isinstance(refused, ev.RequestFailed) and refused.kind == "no_such_adapter"
    assert "no LoRA adapter named 'missing'; loaded: sparse, terse, verbose" in refused.message
    assert served.tokens == tuple(TOKENS)


def test_a_lease_runs_through_the_adapter_of_the_pass_that_granted_it() -> None:
    kv = Kv()
    slot = SamplingSlot(index=len(TOKENS) - 1, op=Argmax())
    request = kv.submit(kv.create(), TOKENS, slots=(slot,), fast=True, adapter="verbose")

    assert request.lease is not None and request.lease.adapter == "verbose"


def test_a_lane_takes_only_passes_through_its_leases_adapter() -> None:
    lanes = Lanes(page_size=PAGE, vocab_size=100, depth=0, post=lambda events: None)
    lanes.open_requester("p")
    lease = Lease(
        lease=1,
        context=1,
        requester="p",
        pages=(3, 4),
        owned=1,
        masked_pages=(),
        next_slot=2,
        next_position=2,
        op=Argmax(),
        adapter="terse",
    )
    lanes.run(lanes.opened(lease, TokenOutput(token=5)))
    slots = (SamplingSlot(index=0, op=Argmax()),)

    def ignore(_: Any) -> None:
        pass

    assert not lanes.submit(1, "p", 1, (5,), None, slots, ignore, adapter="sparse")
    lanes.run(lanes.opened(lease, TokenOutput(token=5)))
    assert lanes.submit(1, "p", 2, (5,), None, slots, ignore, adapter="terse")
