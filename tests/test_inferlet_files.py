"""Inferlets' files: /scratch lives as long as its instance, /data as long as its user, and both
are held to their quotas by the watcher (and by one last measurement when an instance ends).
The measuring and naming are tested on their own; the rest on the synthetic driver with a guest."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.actors.inferlet.files import (
    FileLayout,
    InstanceFiles,
    Quota,
    Usage,
    measure,
    unlinked_open,
    user_directory_name,
)
from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.events import inferlet as ev
from pie.events.inferlet import InferletOutcome
from pie.sandbox import KillSwitch, RunOutcome, SandboxLimits
from tests.inferlet_fixtures import GUESTS, CompiledGuest, compile_guest
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)

MIB = 1 << 20


@pytest.mark.unit
def test_user_directory_names_stay_in_one_directory_and_apart() -> None:
    users = ["alice", "Alice", "..", ".", "", "../alice", "a/b", "a_b", "/etc/passwd", "\x00x"]
    users += ["-rf", "名前", "x" * 500, "a\\..\\b", "\ud800"]
    names = [user_directory_name(user) for user in users]
    assert len(set(names)) == len(users)
    for name in names:
        assert os.sep not in name and "\\" not in name and "\x00" not in name
        assert not name.startswith((".", "-")) and len(name) <= 49
        assert Path("/root", name).resolve().parent == Path("/root")
    assert user_directory_name("alice").startswith("alice-")


@pytest.mark.unit
def test_measure_counts_what_is_nested_and_stops_once_over(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "one").write_bytes(b"1" * 100)
    (tmp_path / "two").write_bytes(b"2" * 50)
    assert measure(str(tmp_path)) == Usage(bytes=150, files=4)
    assert measure(str(tmp_path), Quota(max_files=1)).files == 2
    for name in range(20):
        (tmp_path / f"more{name}").write_bytes(b"3" * 10)
    stopped = measure(str(tmp_path), Quota(max_bytes=60))
    assert 60 < stopped.bytes < 350 and stopped.files < 24


@pytest.mark.unit
def test_measure_does_not_follow_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 10_000)
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "link").symlink_to(outside, target_is_directory=True)
    usage = measure(str(inside))
    assert usage.files == 1 and usage.bytes < 1000


def watched_scratch(tmp_path: Path, quota: Quota) -> tuple[InstanceFiles, KillSwitch, Path]:
    files = InstanceFiles(FileLayout(scratch_root=str(tmp_path), scratch_quota=quota))
    kill = KillSwitch()
    limits = files.prepare("i1", "alice", kill, SandboxLimits())
    assert limits.scratch_dir is not None and limits.data_dir is None
    return files, kill, Path(limits.scratch_dir)


@pytest.mark.unit
def test_the_watcher_stops_an_instance_over_its_quota(tmp_path: Path) -> None:
    files, kill, scratch = watched_scratch(tmp_path, Quota(max_bytes=MIB))
    (scratch / "half").write_bytes(b"x" * (MIB // 2))
    files.check()
    assert not kill.killed
    (scratch / "more").write_bytes(b"x" * MIB)
    files.check()
    assert kill.status == "quota"
    assert kill.reason == "/scratch holds more than its quota of 1 MiB (at least 1.5 MiB)"


@pytest.mark.unit
def test_finishing_removes_scratch_and_fails_an_instance_that_ended_over_quota(
    tmp_path: Path,
) -> None:
    files, kill, scratch = watched_scratch(tmp_path, Quota(max_files=3))
    for name in range(5):
        (scratch / str(name)).touch()
    ended = files.finish("i1", RunOutcome(status="returned", value="ok", seconds=1.0))
    assert ended is not None and ended.status == "quota" and ended.value is None
    assert (
        ended.error == "/scratch holds more than its quota of 3 files and directories (at least 4)"
    )
    assert list(tmp_path.iterdir()) == []
    files.check()
    assert not kill.killed


@pytest.mark.unit
def test_a_user_directory_over_quota_may_shrink_but_not_grow(tmp_path: Path) -> None:
    files = InstanceFiles(
        FileLayout(persist_root=str(tmp_path), persist_quota=Quota(max_bytes=MIB))
    )
    data = tmp_path / user_directory_name("alice")
    data.mkdir()
    (data / "big").write_bytes(b"x" * 2 * MIB)
    kill = KillSwitch()
    assert files.prepare("i1", "alice", kill, SandboxLimits()).data_dir == str(data)
    (data / "big").write_bytes(b"x" * MIB)
    files.check()
    assert not kill.killed
    (data / "more").write_bytes(b"x" * 2 * MIB)
    files.check()
    assert kill.status == "quota" and "may not grow" in (kill.reason or "")


@pytest.mark.unit
def test_files_removed_while_open_are_found_under_their_root(tmp_path: Path) -> None:
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    with contextlib.ExitStack() as stack:
        for directory, name in ((inside, "gone"), (outside, "gone"), (inside, "kept")):
            file = stack.enter_context(open(directory / name, "wb"))
            file.write(b"x" * 1000)
            file.flush()
        again = stack.enter_context(open(inside / "gone", "rb"))
        (inside / "gone").unlink()
        (outside / "gone").unlink()
        assert again.read(1) == b"x"
        assert unlinked_open([str(inside)]) == {str(inside): Usage(bytes=1000, files=1)}
    assert unlinked_open([str(inside)]) == {}


@pytest.mark.unit
def test_the_watcher_counts_a_removed_file_still_held_open(tmp_path: Path) -> None:
    files, kill, scratch = watched_scratch(tmp_path, Quota(max_bytes=MIB))
    with open(scratch / "hidden", "wb") as file:
        (scratch / "hidden").unlink()
        file.write(b"x" * (MIB // 2))
        file.flush()
        files.check()
        assert not kill.killed
        file.write(b"x" * MIB)
        file.flush()
        assert list(scratch.iterdir()) == []
        files.check()
    assert kill.status == "quota"
    assert kill.reason == "/scratch holds more than its quota of 1 MiB (at least 1.5 MiB)"


@pytest.fixture(scope="module")
def filer(
    built: Callable[[Path], Path],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> CompiledGuest:
    return compile_guest(built, tmp_path_factory, GUESTS / "filer")


class Files:
    """An engine running the filer guest."""

    def __init__(self, engine: Engine, program: str) -> None:
        self.engine = engine
        self.program = program

    async def run(self, user: str = "local", **request: Any) -> InferletOutcome:
        with trio.fail_after(60):
            return await self.engine.run_inferlet(self.program, json.dumps(request), user=user)

    async def look_while_waiting(
        self, look: Callable[[], Any], **request: Any
    ) -> tuple[Any, InferletOutcome]:
        """Runs `request` with `wait`: once the guest says it waits, `look()`, then let it end."""
        async with self.engine.requester() as requester:
            with trio.fail_after(60):
                run = await requester.launch(self.program, json.dumps({**request, "wait": True}))
                async for event in run.events:
                    if isinstance(event, ev.SessionMessage):
                        break
                seen = look()
                await run.send("go")
                return seen, await run.outcome()


@contextlib.asynccontextmanager
async def files_engine(filer: CompiledGuest, **sandbox: Any) -> AsyncIterator[Files]:
    cache = str(filer.components)
    config = with_overrides(EngineConfig(), sandbox={"cache_dir": cache, **sandbox})
    async with open_engine(config, driver=SyntheticDriver()) as engine:
        yield Files(engine, engine.programs.add(filer.wasm).hash)


@pytest.mark.integration
async def test_no_scratch_and_no_data_by_default(filer: CompiledGuest, tmp_path: Path) -> None:
    async with files_engine(filer) as files:
        looked = await files.run(mode="look")
        wrote = await files.run(mode="write", path="/data/note.txt", text="x")
    assert looked.ok and wrote.status == "failed"
    listing = json.loads(looked.result or "")
    assert isinstance(listing["/scratch"], str) and isinstance(listing["/data"], str)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
async def test_scratch_is_removed_when_the_instance_ends(
    filer: CompiledGuest, tmp_path: Path
) -> None:
    root = tmp_path / "scratch"
    async with files_engine(filer, scratch_dir=str(root)) as files:
        seen, outcome = await files.look_while_waiting(
            lambda: [p.read_text() for p in root.glob("*/note.txt")],
            mode="write",
            path="/scratch/note.txt",
            text="kept",
        )
        again = await files.run(mode="look")
    assert outcome.ok and seen == ["kept"]
    assert again.ok and json.loads(again.result or "")["/scratch"] == []
    assert list(root.iterdir()) == []


@pytest.mark.integration
async def test_writing_past_the_quota_stops_the_inferlet_and_others_carry_on(
    filer: CompiledGuest, tmp_path: Path
) -> None:
    root = tmp_path / "scratch"
    async with files_engine(
        filer, scratch_dir=str(root), scratch_quota_mb=1, files_check_ms=10
    ) as files:
        stopped = await files.run(mode="write", path="/scratch/big", size=2 * MIB, wait=True)
        after = await files.run(mode="write", path="/scratch/small", size=1000)
        stats = files.engine.statistics().inferlets
    assert stopped.status == "quota"
    said = r"/scratch holds more than its quota of 1 MiB \(at least ([\d.]+) (MiB|bytes)\)"
    used = re.fullmatch(said, stopped.error or "")
    assert used is not None
    assert float(used[1]) * (MIB if used[2] == "MiB" else 1) > MIB
    assert after.ok and stats.running == 0
    assert list(root.iterdir()) == []


@pytest.mark.integration
async def test_an_inferlet_that_ends_over_quota_fails(filer: CompiledGuest, tmp_path: Path) -> None:
    async with files_engine(
        filer,
        scratch_dir=str(tmp_path / "scratch"),
        scratch_max_files=5,
        files_check_ms=600_000,
    ) as files:
        outcome = await files.run(mode="many", dir="/scratch", count=10)
    assert outcome.status == "quota"
    assert (outcome.error or "").startswith("/scratch holds more than its quota of 5 files")


@pytest.mark.integration
async def test_data_outlives_the_run_for_its_user_only(
    filer: CompiledGuest, tmp_path: Path
) -> None:
    persist = tmp_path / "persist"
    async with files_engine(filer, persist_dir=str(persist)) as files:
        wrote = await files.run("alice", mode="write", path="/data/note.txt", text="remember")
        kept = await files.run("alice", mode="read", path="/data/note.txt")
        other = await files.run("bob", mode="read", path="/data/note.txt")
        bobs = await files.run("bob", mode="look")
    assert wrote.ok and kept.result == "remember"
    assert other.result == "FileNotFoundError"
    assert json.loads(bobs.result or "")["/data"] == []
    assert (persist / user_directory_name("alice") / "note.txt").read_text() == "remember"


@pytest.mark.integration
async def test_user_names_that_look_like_paths_stay_inside_persist_dir(
    filer: CompiledGuest, tmp_path: Path
) -> None:
    persist = tmp_path / "deep" / "persist"
    users = ["..", "../..", "../escape", "/tmp/abs", "a/../../b", "."]
    async with files_engine(filer, persist_dir=str(persist)) as files:
        for user in users:
            wrote = await files.run(user, mode="write", path="/data/note.txt", text=user)
            assert wrote.ok, wrote.error
        read = [
            (await files.run(user, mode="read", path="/data/note.txt")).result for user in users
        ]
    assert read == users
    notes = sorted(tmp_path.rglob("note.txt"))
    assert len(notes) == len(users)
    assert all(note.parent.parent == persist for note in notes)
    assert [p.name for p in tmp_path.iterdir()] == ["deep"]


@pytest.mark.integration
async def test_a_user_over_quota_is_stopped_and_may_still_clean_up(
    filer: CompiledGuest, tmp_path: Path
) -> None:
    persist = tmp_path / "persist"
    async with files_engine(
        filer, persist_dir=str(persist), persist_quota_mb=1, files_check_ms=10
    ) as files:
        over = await files.run("alice", mode="write", path="/data/big", size=2 * MIB, wait=True)
        removed = await files.run("alice", mode="remove", path="/data/big")
        fits = await files.run("alice", mode="write", path="/data/small", size=1000)
    assert over.status == "quota"
    assert (over.error or "").startswith("/data holds more than its quota of 1 MiB")
    assert removed.ok and fits.ok
    assert [p.name for p in (persist / user_directory_name("alice")).iterdir()] == ["small"]


@pytest.mark.integration
async def test_a_directory_that_cannot_be_made_fails_the_inferlet_only(
    filer: CompiledGuest, tmp_path: Path
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("a file where the scratch root should be")
    async with files_engine(filer, scratch_dir=str(taken)) as files:
        first = await files.run(mode="look")
        second = await files.run(mode="look")
        stats = files.engine.statistics().inferlets
    for outcome in (first, second):
        assert outcome.status == "failed"
        assert (outcome.error or "").startswith(
            "the engine could not make the program's directories"
        )
    assert stats.running == 0 and stats.failed == 2


@pytest.mark.unit
def test_a_quota_error_never_shows_the_usage_as_the_quota(tmp_path: Path) -> None:
    files, kill, scratch = watched_scratch(tmp_path, Quota(max_bytes=MIB))
    (scratch / "just-over").write_bytes(b"x" * (MIB + 100))
    files.check()
    assert kill.reason == (
        f"/scratch holds more than its quota of 1 MiB (at least {MIB + 100} bytes)"
    )
