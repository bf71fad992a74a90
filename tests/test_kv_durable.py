"""Named snapshots kept on disk: the record store (written, read back, removed, damaged records
left out) and an engine that finds a snapshot saved by the engine before it, rebuilt through the
adapters and under the attention masks its tokens ran through."""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from attrs import evolve

from pie.actors.kv.context import Chain
from pie.actors.kv.durable import SnapshotRecord, SnapshotStore
from pie.actors.requester import RequestRefused
from pie.config import EngineConfig, with_overrides
from pie.drivers.factory import build_torch_driver
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import open_engine, with_snapshots_dir
from pie.events import kv as kv_ev
from pie.events.sampling import Argmax, LogitsOutput, RawLogits, SamplingSlot, TokenOutput
from tests.tiny_models import save_tiny_model

PAGE = 4


def record(user: str = "alice", name: str = "draft", count: int = 6) -> SnapshotRecord:
    return SnapshotRecord(
        user=user,
        name=name,
        tokens=tuple(range(10, 10 + count)),
        positions=tuple(range(count)),
        masked=(0,),
    )


@pytest.mark.unit
def test_a_written_record_reads_back_equal(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.write(record())
    store.write(record(name="other/../odd name"))
    store.write(record(user="bob"))
    assert SnapshotStore(tmp_path).read_all() == sorted(
        [record(), record(name="other/../odd name"), record(user="bob")],
        key=lambda r: str(store._path(r.user, r.name)),
    )


@pytest.mark.unit
def test_a_record_is_taken_from_a_snapshots_chain() -> None:
    chain = Chain(owner="snapshot:alice", tokens=[5, 6, 7], positions=[0, 1, 9], masked={2, 0})
    assert SnapshotRecord.of("alice", "s", chain) == SnapshotRecord(
        user="alice", name="s", tokens=(5, 6, 7), positions=(0, 1, 9), masked=(0, 2)
    )


@pytest.mark.unit
def test_writing_again_replaces_the_record_of_the_same_name(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.write(record(count=6))
    store.write(record(count=2))
    assert store.read_all() == [record(count=2)]


@pytest.mark.unit
def test_writing_the_same_record_again_leaves_its_file_alone(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.write(record())
    path = store._path("alice", "draft")
    before = path.stat().st_ino
    store.write(record())
    assert path.stat().st_ino == before


@pytest.mark.unit
def test_removed_and_dropped_records_are_gone(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    for name in ("a", "b"):
        store.write(record(name=name))
        store.write(record(user="bob", name=name))
    store.remove("alice", "a")
    store.remove("alice", "never saved")
    assert {(r.user, r.name) for r in store.read_all()} == {
        ("alice", "b"),
        ("bob", "a"),
        ("bob", "b"),
    }
    store.drop("bob")
    store.drop("nobody")
    assert store.read_all() == [record(name="b")]


@pytest.mark.unit
@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b'{"user": "alice", "name": "draft", "tok',
        b"[1, 2]",
        b'{"user": "alice", "name": "draft", "tokens": [1], "positions": [], "masked": []}',
        b'{"user": "alice", "name": "draft", "tokens": [-1], "positions": [0], "masked": []}',
        b'{"user": "alice", "name": "draft", "tokens": [1.5], "positions": [0], "masked": []}',
        b'{"user": 1, "name": "draft", "tokens": [1], "positions": [0], "masked": []}',
        b'{"user": "alice", "name": "draft", "tokens": [], "positions": [], "masked": [], "x": 1}',
        b'{"user": "eve", "name": "draft", "tokens": [], "positions": [], "masked": []}',
    ],
)
def test_a_damaged_record_is_logged_and_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: bytes
) -> None:
    store = SnapshotStore(tmp_path)
    store.write(record())
    store.write(record(name="kept"))
    store._path("alice", "draft").write_bytes(damage)
    with caplog.at_level(logging.WARNING):
        assert store.read_all() == [record(name="kept")]
    assert "left out" in caplog.text


@pytest.mark.unit
def test_temporary_files_a_kill_left_are_removed_at_reading(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.write(record())
    leftover = store._path("alice", "draft").with_name(".half.json.123.tmp")
    leftover.write_bytes(b"{")
    assert store.read_all() == [record()]
    assert not leftover.exists()


@pytest.mark.unit
def test_pie_serve_keeps_snapshots_beside_the_compiled_components(tmp_path: Path) -> None:
    assert EngineConfig().kv.snapshots_dir == ""
    config = with_overrides(EngineConfig(), sandbox={"cache_dir": str(tmp_path / "components")})
    assert with_snapshots_dir(config).kv.snapshots_dir == str(tmp_path / "snapshots")
    chosen = with_overrides(config, kv={"snapshots_dir": str(tmp_path / "mine")})
    assert with_snapshots_dir(chosen) == chosen


# -- the engine ------------------------------------------------------------------------------


def engine_config(directory: Path, **kv: object) -> EngineConfig:
    return with_overrides(EngineConfig(), kv={"snapshots_dir": str(directory), **kv})


def driver() -> SyntheticDriver:
    return SyntheticDriver(page_size=PAGE, num_pages=64)


GREEDY = (SamplingSlot(index=0, op=Argmax()),)


def next_token(outputs: tuple[object, ...]) -> int:
    (output,) = outputs
    assert isinstance(output, TokenOutput)
    return output.token


@pytest.mark.integration
async def test_a_snapshot_survives_the_engine_and_opens_with_its_tokens(tmp_path: Path) -> None:
    prompt = list(range(20, 31))
    with trio.fail_after(20):
        async with open_engine(engine_config(tmp_path), driver=driver()) as engine:
            async with engine.requester() as r:
                context = await r.create_context(user="alice")
                await r.forward(context, prompt, positions=tuple(range(3, 14)))
                await r.mask_pages(context, (1,))
                await r.save(context, "draft", user="alice")
                before = await r.describe(await r.open("draft", user="alice"))
                opened = await r.open("draft", user="alice")
                expected = next_token(await r.forward(opened, [7], GREEDY))
        assert [(x.user, x.name) for x in SnapshotStore(tmp_path).read_all()] == [
            ("alice", "draft")
        ]
        rebuilt = driver()
        async with open_engine(engine_config(tmp_path), driver=rebuilt) as engine:
            assert engine.statistics().kv.snapshots == 1
            async with engine.requester() as r:
                opened = await r.open("draft", user="alice")
                after = await r.describe(opened)
                assert next_token(await r.forward(opened, [7], GREEDY)) == expected
                with pytest.raises(RequestRefused) as hidden:
                    await r.open("draft", user="bob")
                assert hidden.value.kind == "no_such_snapshot"
    assert (after.tokens, after.positions, after.masked_pages) == (
        before.tokens,
        before.positions,
        before.masked_pages,
    )
    assert (after.tokens, after.positions, after.masked_pages) == (
        tuple(prompt),
        tuple(range(3, 14)),
        (1,),
    )
    # The rebuild recomputed the prompt into fresh pages: its tokens reached the driver again.
    assert prompt == [t for b in rebuilt.batches for t in b.token_ids][: len(prompt)]


@pytest.mark.integration
async def test_deleted_taken_and_dropped_snapshots_stay_gone(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with open_engine(engine_config(tmp_path), driver=driver()) as engine:
            async with engine.requester() as r:
                for user, name in [("alice", "a"), ("alice", "b"), ("alice", "c"), ("bob", "x")]:
                    context = await r.create_context(user=user)
                    await r.forward(context, [1, 2, 3])
                    await r.save(context, name, user=user)
                await r.delete_snapshot("a", user="alice")
                await r.open("b", user="alice", take=True)
                await r.call("kv", kv_ev.DropSnapshots, user="bob")
        async with open_engine(engine_config(tmp_path), driver=driver()) as engine:
            assert set(engine.kv.core.snapshots) == {("alice", "c")}


@pytest.mark.integration
async def test_recovered_snapshots_still_count_against_the_snapshot_quota(tmp_path: Path) -> None:
    # A pool of 64 pages with a snapshot share of 1/8: each user's snapshots hold at most 8.
    config = engine_config(tmp_path, snapshot_page_share=0.125)
    with trio.fail_after(20):
        async with open_engine(config, driver=driver()) as engine:
            async with engine.requester() as r:
                context = await r.create_context(user="alice")
                await r.forward(context, list(range(1, 1 + 6 * PAGE)))
                await r.save(context, "big", user="alice")
        async with open_engine(config, driver=driver()) as engine:
            async with engine.requester() as r:
                context = await r.create_context(user="alice")
                await r.forward(context, list(range(100, 100 + 3 * PAGE)))
                with pytest.raises(RequestRefused) as refused:
                    await r.save(context, "more", user="alice")
                assert refused.value.kind == "snapshot_quota"
                assert "9 KV pages" in refused.value.message


@pytest.mark.integration
async def test_a_save_that_cannot_be_kept_on_disk_is_refused_and_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self: SnapshotStore, record: SnapshotRecord) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with trio.fail_after(20):
        async with open_engine(engine_config(tmp_path), driver=driver()) as engine:
            monkeypatch.setattr(SnapshotStore, "write", full)
            async with engine.requester() as r:
                context = await r.create_context(user="alice")
                await r.forward(context, [1, 2, 3])
                with pytest.raises(RequestRefused) as refused:
                    await r.save(context, "draft", user="alice")
                assert refused.value.kind == "internal" and "kept on disk" in refused.value.message
                assert engine.kv.core.snapshots == {}
                monkeypatch.undo()
                await r.save(context, "draft", user="alice")
                assert set(engine.kv.core.snapshots) == {("alice", "draft")}


@pytest.mark.integration
async def test_an_engine_without_a_directory_keeps_snapshots_in_memory_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with trio.fail_after(20):
        async with open_engine(driver=driver()) as engine:
            assert engine.kv.store is None
            async with engine.requester() as r:
                context = await r.create_context()
                await r.forward(context, [1, 2, 3])
                await r.save(context, "draft")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
async def test_a_snapshot_that_no_longer_fits_is_logged_and_its_record_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(20):
        async with open_engine(engine_config(tmp_path), driver=driver()) as engine:
            async with engine.requester() as r:
                for name, pages in [("small", 1), ("big", 6)]:
                    context = await r.create_context(user="alice")
                    await r.forward(context, list(range(1, 1 + pages * PAGE)))
                    await r.save(context, name, user="alice")
        smaller = engine_config(tmp_path, snapshot_page_share=0.0625)  # 4 of 64 pages
        with caplog.at_level(logging.WARNING):
            async with open_engine(smaller, driver=driver()) as engine:
                assert set(engine.kv.core.snapshots) == {("alice", "small")}
                assert engine.statistics().kv.pages_free == 64 - 1
    assert "'big' of 'alice' not rebuilt" in caplog.text and "snapshot_quota" in caplog.text
    assert len(SnapshotStore(tmp_path).read_all()) == 2


@pytest.mark.integration
async def test_a_damaged_record_does_not_stop_the_engine_from_starting(tmp_path: Path) -> None:
    SnapshotStore(tmp_path).write(record(count=3))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "broken.json").write_bytes(b"\x00\xff{")
    with trio.fail_after(20):
        async with open_engine(engine_config(tmp_path), driver=driver()) as engine:
            assert set(engine.kv.core.snapshots) == {("alice", "draft")}
            async with engine.requester() as r:
                info = await r.describe(await r.open("draft", user="alice"))
    assert (info.tokens, info.masked_pages) == ((10, 11, 12), (0,))


@pytest.mark.unit
def test_a_record_keeps_the_adapter_each_run_of_tokens_went_through(tmp_path: Path) -> None:
    chain = Chain(owner="snapshot:alice", tokens=list(range(9)), positions=list(range(9)))
    chain.run_adapter(0, None)
    chain.run_adapter(2, "sql")
    chain.run_adapter(4, "sql")
    chain.run_adapter(6, None)
    taken = SnapshotRecord.of("alice", "s", chain)
    assert taken.adapters == ((2, "sql"), (6, None))
    assert taken.segments() == [(0, 2, None, None), (2, 6, "sql", None), (6, 9, None, None)]
    store = SnapshotStore(tmp_path)
    store.write(taken)
    assert store.read_all() == [taken]
    chain.cut_runs(6)
    assert chain.adapter_runs == [(2, "sql")]
    assert record().segments() == [(0, 6, None, None)] and b"adapters" not in record().encode()


@pytest.mark.unit
@pytest.mark.parametrize("runs", ['"sql"', "[[1]]", '[["1", "sql"]]', "[[1, 2]]"])
def test_a_record_with_malformed_adapter_runs_is_refused(runs: str) -> None:
    body = record().encode().decode().removesuffix("}") + f',"adapters":{runs}}}'
    with pytest.raises(ValueError, match="adapters must be"):
        SnapshotRecord.decode(body.encode())


@pytest.mark.integration
async def test_a_snapshot_is_rebuilt_through_the_adapters_its_tokens_ran_through(
    tmp_path: Path,
) -> None:
    def adapted() -> SyntheticDriver:
        synthetic = driver()
        synthetic.info = evolve(synthetic.info, adapters=("sql",))
        return synthetic

    runs = [([20, 21, 22], None), ([23, 24, 25, 26], "sql"), ([27, 28], None)]
    with trio.fail_after(20):
        async with open_engine(engine_config(tmp_path), driver=adapted()) as engine:
            async with engine.requester() as r:
                context = await r.create_context(user="alice")
                for tokens, adapter in runs:
                    await r.forward(context, tokens, adapter=adapter)
                await r.save(context, "draft", user="alice")
        # Started without the adapter: the snapshot cannot be rebuilt and its record is kept.
        async with open_engine(engine_config(tmp_path), driver=driver()) as engine:
            assert engine.statistics().kv.snapshots == 0
        rebuilt = adapted()
        async with open_engine(engine_config(tmp_path), driver=rebuilt) as engine:
            assert engine.statistics().kv.snapshots == 1
    passes = [
        (b.token_ids[b.qo_indptr[i] : b.qo_indptr[i + 1]], b.adapters[i])
        for b in rebuilt.batches
        for i in range(b.num_requests)
    ]
    assert passes == runs


@pytest.mark.unit
def test_a_record_keeps_the_attention_masks_its_tokens_ran_under(tmp_path: Path) -> None:
    chain = Chain(owner="snapshot:alice", tokens=list(range(9)), positions=list(range(9)))
    chain.run_adapter(3, "sql")
    chain.run_masks(2, ((1, 1, 1), (4,)))
    chain.run_masks(6, ((2, 5),))
    taken = SnapshotRecord.of("alice", "s", chain)
    assert taken.masks == ((2, ((1, 1, 1), (4,))), (6, ((2, 5),)))
    # Each pass of the rebuild runs one adapter, causally or under its own tokens' masks.
    assert taken.segments() == [
        (0, 2, None, None),
        (2, 3, None, ((1, 1, 1),)),
        (3, 4, "sql", ((4,),)),
        (4, 6, "sql", None),
        (6, 7, "sql", ((2, 5),)),
        (7, 9, "sql", None),
    ]
    store = SnapshotStore(tmp_path)
    store.write(taken)
    assert store.read_all() == [taken]
    assert b"masks" not in record().encode()


@pytest.mark.unit
def test_a_record_written_before_masks_were_kept_reads_as_causal() -> None:
    old = b'{"user":"alice","name":"draft","tokens":[10,11],"positions":[0,1],"masked":[]}'
    decoded = SnapshotRecord.decode(old)
    assert decoded.masks == () and decoded.segments() == [(0, 2, None, None)]


@pytest.mark.unit
@pytest.mark.parametrize(
    "runs",
    [
        '"tree"',
        "[[1]]",
        "[[1, []]]",
        '[["1", [[2]]]]',
        "[[1, [2]]]",
        "[[1, [[-1, 3]]]]",
        "[[1, [[true, 1]]]]",
        "[[1, [[1, 0.5]]]]",
        "[[-1, [[0]]]]",
        "[[1, [[1]]]]",
        "[[1, [[2], [2]]]]",
        "[[5, [[6], [7]]]]",
        "[[1, [[2], [3]]], [2, [[3]]]]",
        "[[3, [[4]]], [1, [[2]]]]",
    ],
)
def test_a_record_with_malformed_mask_runs_is_refused(runs: str) -> None:
    body = record().encode().decode().removesuffix("}") + f',"masks":{runs}}}'
    with pytest.raises(ValueError, match="mask"):
        SnapshotRecord.decode(body.encode())


def tiny_config(folder: Path) -> EngineConfig:
    model = {"path": str(folder / "model"), "dtype": "float32", "device": "cpu"}
    kv = {"snapshots_dir": str(folder / "snapshots"), "page_size": PAGE, "num_pages": 64}
    return with_overrides(EngineConfig(), model=model, kv=kv)


async def next_logits(r: Any, context: int, token: int) -> torch.Tensor:
    (output,) = await r.forward(context, [token], (SamplingSlot(index=0, op=RawLogits()),))
    assert isinstance(output, LogitsOutput)
    return torch.tensor(output.values)


@pytest.mark.integration
async def test_a_snapshot_is_rebuilt_under_the_attention_masks_its_tokens_ran_under(
    tmp_path: Path,
) -> None:
    save_tiny_model(tmp_path / "model", dict(model_type="llama"))
    config = tiny_config(tmp_path)
    prompt, branch = [5, 17, 42, 99], [7, 30, 31]
    # A tree over the prompt: every branch token hides prompt token 1, the second also hides
    # the first (a sibling); its mask covers the whole pass, the slots after it hidden anyway.
    masks = ((1, 1, 3), (1, 1, 2, 1, 1, 1), (1, 1, 5))
    with trio.fail_after(30):
        driver, tokenizer = await trio.to_thread.run_sync(build_torch_driver, config)
        async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
            async with engine.requester() as r:
                context = await r.create_context(user="alice")
                await r.forward(context, prompt)
                await r.forward(context, branch, attention_masks=masks)
                await r.truncate(context, 1)
                await r.save(context, "tree", user="alice")
                saved = await next_logits(r, await r.open("tree", user="alice"), 9)
                causal = await r.create_context(user="alice")
                await r.forward(causal, prompt + branch[:2])
                unmasked = await next_logits(r, causal, 9)
        driver, tokenizer = await trio.to_thread.run_sync(build_torch_driver, config)
        async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
            assert engine.statistics().kv.snapshots == 1
            async with engine.requester() as r:
                opened = await r.open("tree", user="alice")
                assert (await r.describe(opened)).tokens == tuple(prompt + branch[:2])
                rebuilt = await next_logits(r, opened, 9)
    # Rebuilt causally, the snapshot's KV would give the unmasked logits.
    assert (saved - unmasked).abs().max() > 1e-2
    assert (rebuilt - saved).abs().max() < 1e-5
