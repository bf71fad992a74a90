"""Durable named snapshots that hold media: records keep their media runs and the media's
encoded bytes beside them, once per content hash, gone with the last record that names them;
and on a tiny random Qwen2-VL a snapshot holding a picture comes back after a restart on the
same snapshot directory with the same greedy tokens as before (and transformers')."""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pie.actors.kv.durable import SnapshotRecord, SnapshotStore
from pie.config import config_from_dict
from pie.engine import open_engine
from pie.events.forward import MediaRun
from tests.inferlet_fixtures import GUESTS, run_json
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.test_media_passes import COUNT, TOKENS, greedy_at
from tests.tiny_media import png, save_tiny_vl

ANCHOR = 2
KEY_A, KEY_B = "a" * 32, "b" * 32
SOURCES = {KEY_A: ("image", None, b"picture"), KEY_B: ("video", 4, b"clip")}


def with_media(name: str, *keys: str) -> SnapshotRecord:
    runs = tuple(MediaRun(index=1 + 3 * i, count=2, media=k, offset=0) for i, k in enumerate(keys))
    return SnapshotRecord(
        user="alice", name=name, tokens=tuple(range(8)), positions=tuple(range(8)), media=runs
    )


def save(store: SnapshotStore, record: SnapshotRecord) -> None:
    store.keep_media({run.media: SOURCES[run.media] for run in record.media})
    store.write(record)


def blobs(store: SnapshotStore) -> set[str]:
    return {path.name for path in store.media.directory.iterdir()}


@pytest.mark.unit
def test_media_records_read_back_and_their_blobs_go_with_the_last_record(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    save(store, with_media("one", KEY_A, KEY_B))
    save(store, with_media("two", KEY_A))
    assert SnapshotStore(tmp_path).read_all() == sorted(
        [with_media("one", KEY_A, KEY_B), with_media("two", KEY_A)],
        key=lambda r: str(store._path(r.user, r.name)),
    )
    assert store.media.read(KEY_B) == SOURCES[KEY_B]
    store.remove("alice", "one")
    assert blobs(store) == {KEY_A}
    store.write(with_media("two"))  # replaced by a record without media
    assert blobs(store) == set()


@pytest.mark.unit
def test_blobs_a_kill_left_without_a_record_are_removed_at_start(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    save(store, with_media("kept", KEY_A))
    store.keep_media({KEY_B: SOURCES[KEY_B]})
    assert [r.name for r in SnapshotStore(tmp_path).read_all()] == ["kept"]
    assert blobs(store) == {KEY_A}


@pytest.mark.unit
@pytest.mark.parametrize("key", ["../../etc/passwd", "A" * 32, "a" * 31])
def test_a_record_naming_media_by_anything_but_a_content_hash_is_refused(key: str) -> None:
    data = with_media("x", KEY_A).encode().replace(KEY_A.encode(), key.encode())
    with pytest.raises(ValueError, match="media must be"):
        SnapshotRecord.decode(data)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("media-durable")
    reference = save_tiny_vl(root / "vl", seed=3)
    picture = png(11, 56, 84)
    return SimpleNamespace(
        model=root / "vl",
        picture=base64.b64encode(picture).decode(),
        expected=greedy_at(reference, picture, ANCHOR),
    )


def config(tiny: SimpleNamespace, snapshots: Path) -> Any:
    return config_from_dict(
        {
            "models": [{"name": "vl", "path": str(tiny.model), "dtype": "float32"}],
            "kv": {"num_pages": 128, "page_size": 4, "snapshots_dir": str(snapshots)},
        }
    )


@pytest.mark.integration
async def test_a_snapshot_holding_a_picture_survives_a_restart_with_the_same_tokens(
    tiny: SimpleNamespace,
    tmp_path: Path,
    built: Any,  # noqa: F811
) -> None:
    wasm = built(GUESTS / "media_probe").read_bytes()
    common = {"name": "seen", "images": [tiny.picture], "tokens": TOKENS, "count": COUNT}
    async with open_engine(config(tiny, tmp_path)) as engine:
        program = engine.programs.add(wasm).hash
        await run_json(
            engine, program, {**common, "probe": "passes", "mode": "save", "anchors": [ANCHOR]}
        )
        live = await run_json(engine, program, {**common, "probe": "passes", "mode": "resume"})
    kept = [path.stat().st_size for path in (tmp_path / "media").iterdir()]
    async with open_engine(config(tiny, tmp_path)) as engine:
        program = engine.programs.add(wasm).hash
        held = engine.model("vl").driver.media.statistics()[0]
        restored = await run_json(
            engine, program, {**common, "probe": "passes", "mode": "resume", "delete": True}
        )
    assert live == tiny.expected
    assert restored == live
    assert len(kept) == 1 and kept[0] > len(base64.b64decode(tiny.picture))
    assert held == 0  # the rebuild let go of the picture; its KV holds what it encoded
    assert list((tmp_path / "media").iterdir()) == []
