"""Inferlets' files on the host: a fresh directory per instance at /scratch, a directory per user
at /data that outlives the instance, and one engine-wide watcher that stops an instance whose
directory holds more than its quota (wasmtime's preopens cannot refuse a write, so we measure,
counting the files a guest removed but still holds open)."""

from __future__ import annotations

import hashlib
import math
import os
import re
import secrets
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

import attrs
import trio
from attrs import frozen

from pie.sandbox import KillSwitch, RunOutcome, SandboxLimits

MIB = 1 << 20
SCRATCH = "/scratch"
DATA = "/data"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_FINAL_CHECKED = ("returned", "failed", "trapped")
"""Ends the last measurement may turn into `quota`; a stop for another cause keeps its reason."""


@frozen(kw_only=True)
class Usage:
    bytes: int = 0
    """The apparent size of every file (what was written, holes included)."""
    files: int = 0
    """Files, directories and links, each counted once."""


@frozen(kw_only=True)
class Quota:
    """How much one directory may hold; 0 is no limit."""

    max_bytes: int = 0
    max_files: int = 0

    @property
    def limited(self) -> bool:
        return self.max_bytes > 0 or self.max_files > 0

    def exceeded(self, size: int, files: int) -> bool:
        return 0 < self.max_bytes < size or 0 < self.max_files < files

    def at_least(self, usage: Usage) -> Quota:
        """Raised to `usage` where that is over: a directory that is over its quota already may
        be emptied, but not grown."""
        return Quota(
            max_bytes=self.max_bytes and max(self.max_bytes, usage.bytes),
            max_files=self.max_files and max(self.max_files, usage.files),
        )


def widest(quotas: Iterable[Quota]) -> Quota:
    """The quota no narrower than any of `quotas` (no limit where one has none)."""
    listed = list(quotas)
    sizes = [q.max_bytes for q in listed]
    counts = [q.max_files for q in listed]
    return Quota(
        max_bytes=0 if 0 in sizes else max(sizes, default=0),
        max_files=0 if 0 in counts else max(counts, default=0),
    )


NO_LIMIT = Quota()


def measure(path: str, stop_over: Quota = NO_LIMIT) -> Usage:
    """What is under `path`, links not followed. Counting stops as soon as `stop_over` is
    exceeded, so a directory far over its quota costs no more to check than one at it."""
    size = files = 0
    pending = [path]
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    files += 1
                    size += _size_or_descend(entry, pending)
                    if stop_over.exceeded(size, files):
                        return Usage(bytes=size, files=files)
        except OSError:
            continue  # removed by the guest while we looked
    return Usage(bytes=size, files=files)


def unlinked_open(roots: Iterable[str]) -> dict[str, Usage]:
    """What this process holds open under each of `roots` after it was removed: a guest that
    removes a file it has open may go on writing it, and no walk of the directory sees it. Empty
    where the system has no /proc/self/fd."""
    real = {os.path.realpath(root).rstrip(os.sep) + os.sep: root for root in roots}
    held: dict[str, Usage] = {}
    seen: set[tuple[int, int]] = set()
    try:
        fds = os.listdir(_FDS)
    except OSError:
        return held
    for fd in fds:
        try:
            target = os.readlink(f"{_FDS}/{fd}")
            if not target.endswith(_REMOVED):
                continue
            root = next((real[r] for r in real if target.startswith(r)), None)
            if root is None:
                continue
            stat = os.stat(f"{_FDS}/{fd}")
        except OSError:
            continue  # closed while we looked
        if (stat.st_dev, stat.st_ino) not in seen:
            seen.add((stat.st_dev, stat.st_ino))
            usage = held.get(root, Usage())
            held[root] = Usage(bytes=usage.bytes + stat.st_size, files=usage.files + 1)
    return held


_FDS = "/proc/self/fd"
_REMOVED = " (deleted)"


def _size_or_descend(entry: os.DirEntry[str], pending: list[str]) -> int:
    try:
        if entry.is_dir(follow_symlinks=False):
            pending.append(entry.path)
            return 0
        return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0


def user_directory_name(user: str) -> str:
    """A directory name for `user`, safe whatever the name holds: its letters, digits, `_` and
    `-` (at most 32) for people, then a hash of the whole name, so two users never share one."""
    readable = _UNSAFE.sub("_", user).strip("_-")[:32] or "user"
    digest = hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{readable}-{digest}"


def _amount(size: int) -> str:
    # Rounded down, so that "at least" stays true.
    return f"{math.floor(size * 100 / MIB) / 100:g} MiB" if size >= MIB else f"{size} bytes"


@frozen(kw_only=True)
class FileLayout:
    """Where inferlets' files go and how much each directory may hold ([sandbox] settings)."""

    scratch_root: str = ""
    scratch_quota: Quota = Quota()
    persist_root: str = ""
    persist_quota: Quota = Quota()
    check_seconds: float = 0.1

    @property
    def enabled(self) -> bool:
        return bool(self.scratch_root or self.persist_root)

    @property
    def watched(self) -> bool:
        scratch = bool(self.scratch_root) and self.scratch_quota.limited
        return scratch or (bool(self.persist_root) and self.persist_quota.limited)


@frozen(kw_only=True)
class Area:
    """One directory an instance sees, and how much it may hold while this instance runs."""

    path: str
    guest_path: str
    quota: Quota
    allowance: Quota

    def over(self, usage: Usage) -> bool:
        return self.allowance.exceeded(usage.bytes, usage.files)

    def describe(self, usage: Usage) -> str:
        if 0 < self.allowance.max_bytes < usage.bytes:
            limit, used = _amount(self.quota.max_bytes), _amount(usage.bytes)
            used = f"{usage.bytes} bytes" if used == limit else used
        else:
            limit, used = f"{self.quota.max_files} files and directories", str(usage.files)
        text = f"{self.guest_path} holds more than its quota of {limit} (at least {used})"
        if self.allowance != self.quota:
            text += "; it was over quota already when the program started, so it may not grow"
        return text


class InstanceFiles:
    """Gives each instance its directories, measures them while it runs and once more when it
    ends, and then removes its scratch directory. `prepare`, `check` and `finish` touch the disk:
    call them off the Trio thread (any thread; the bookkeeping is locked)."""

    def __init__(self, layout: FileLayout) -> None:
        self.layout = layout
        self._lock = threading.Lock()
        self._watched: dict[str, tuple[KillSwitch, tuple[Area, ...]]] = {}
        self._scratch: dict[str, str] = {}

    def prepare(
        self, instance: str, user: str, kill: KillSwitch, limits: SandboxLimits
    ) -> SandboxLimits:
        """`limits` with the instance's directories, made if need be; `kill` stops it when one
        holds more than its allowance. Raises OSError when a directory cannot be made."""
        scratch = self._new_scratch(instance) if self.layout.scratch_root else None
        data = self._user_data(user) if self.layout.persist_root else None
        areas = tuple(a for a in (scratch, data) if a is not None and a.quota.limited)
        if areas:
            with self._lock:
                self._watched[instance] = (kill, areas)
        return attrs.evolve(
            limits,
            scratch_dir=scratch.path if scratch else None,
            data_dir=data.path if data else None,
        )

    def _new_scratch(self, instance: str) -> Area:
        # A random suffix: instance ids start again at i1 in each engine process.
        path = Path(self.layout.scratch_root) / f"{instance}-{secrets.token_hex(4)}"
        path.mkdir(parents=True)
        with self._lock:
            self._scratch[instance] = str(path)
        quota = self.layout.scratch_quota
        return Area(path=str(path), guest_path=SCRATCH, quota=quota, allowance=quota)

    def _user_data(self, user: str) -> Area:
        path = Path(self.layout.persist_root) / user_directory_name(user)
        path.mkdir(parents=True, exist_ok=True)
        quota = self.layout.persist_quota
        allowance = quota
        if quota.limited:
            usage = measure(str(path), quota)
            if quota.exceeded(usage.bytes, usage.files):
                allowance = quota.at_least(measure(str(path)))
        return Area(path=str(path), guest_path=DATA, quota=quota, allowance=allowance)

    def check(self) -> None:
        """Measures each watched directory once and stops every instance it is too full for."""
        with self._lock:
            watched = list(self._watched.values())
        sharing: dict[str, list[tuple[KillSwitch, Area]]] = {}
        for kill, areas in watched:
            for area in areas:
                if not kill.killed:
                    sharing.setdefault(area.path, []).append((kill, area))
        hidden = unlinked_open(sharing) if sharing else {}
        for path, users in sharing.items():
            usage = measure(path, widest(area.allowance for _, area in users))
            if path in hidden:
                usage = Usage(
                    bytes=usage.bytes + hidden[path].bytes, files=usage.files + hidden[path].files
                )
            for kill, area in users:
                if area.over(usage):
                    kill.kill(area.describe(usage), "quota")

    def finish(self, instance: str, outcome: RunOutcome | None) -> RunOutcome | None:
        """Forgets `instance` after a last measurement (an instance that ended with a directory
        over its allowance fails `quota`) and removes its scratch directory."""
        with self._lock:
            watched = self._watched.pop(instance, None)
            scratch = self._scratch.pop(instance, None)
        if watched is not None and outcome is not None and outcome.status in _FINAL_CHECKED:
            outcome = _last_check(watched[1], outcome)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        return outcome

    async def watch(self) -> None:
        """Checks every `check_seconds` while an instance has a quota to keep; until cancelled."""
        if not self.layout.watched:
            return
        while True:
            await trio.sleep(self.layout.check_seconds)
            if self._watched:
                await trio.to_thread.run_sync(self.check)


def _last_check(areas: tuple[Area, ...], outcome: RunOutcome) -> RunOutcome:
    for area in areas:
        usage = measure(area.path, area.allowance)
        if area.over(usage):
            error = area.describe(usage)
            if outcome.error:
                error += f" (the program had ended {outcome.status}: {outcome.error})"
            return attrs.evolve(outcome, status="quota", value=None, error=error)
    return outcome
