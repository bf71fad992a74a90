"""Programs users installed, kept on disk so a restarted server knows them again: the bytes as
`<sha256>.wasm` and each user's names in `users/<digest of the user>.json`, every file written
atomically (a temporary file, fsync, rename) so a kill leaves the old or the new one."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

from pie.actors.inferlet.programs import ProgramError, ProgramInfo, ProgramRegistry
from pie.durable import write_atomically

log = logging.getLogger(__name__)


class InstalledPrograms:
    """Call `record` and `restore` off the event loop (they read, write and fsync files)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._users = self.directory / "users"
        self._lock = threading.Lock()

    def record(self, user: str, info: ProgramInfo, wasm: bytes) -> None:
        """Keeps `user`'s binding of `info.name@info.version` to `wasm`; a failure to write is
        logged (the program stays installed until the server stops)."""
        try:
            self._record(user, info, wasm)
        except OSError as exc:
            log.warning("installed programs: could not keep %s of %s: %s", info.name, user, exc)

    def _record(self, user: str, info: ProgramInfo, wasm: bytes) -> None:
        with self._lock:
            self._users.mkdir(parents=True, exist_ok=True)
            program = self.directory / f"{info.hash}.wasm"
            if not program.exists():
                write_atomically(program, wasm)
            path = self._user_file(user)
            names = _read_names(path)
            entry = {"name": info.name, "version": info.version, "hash": info.hash}
            if entry not in names:
                names.append(entry)
                body = {"user": user, "programs": names}
                write_atomically(path, json.dumps(body, indent=1).encode())

    def restore(self, registry: ProgramRegistry) -> int:
        """Adds every kept binding to `registry`; returns how many. A damaged file or entry is
        logged and left out."""
        restored = 0
        for path in sorted(self._users.glob("*.json")):
            try:
                body = json.loads(path.read_bytes())
                user, names = body["user"], body["programs"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("installed programs: %s is unreadable (%s)", path, exc)
                continue
            restored += sum(self._restore_one(registry, user, entry) for entry in names)
        return restored

    def _restore_one(self, registry: ProgramRegistry, user: str, entry: dict[str, str]) -> bool:
        try:
            digest = entry["hash"]
            wasm = (self.directory / f"{digest}.wasm").read_bytes()
            if hashlib.sha256(wasm).hexdigest() != digest:
                raise ValueError("the bytes do not hash to their name")
            registry.add(wasm, entry["name"], entry["version"], owner=user, digest=digest)
        except (OSError, ValueError, KeyError, TypeError, ProgramError) as exc:
            log.warning("installed programs: %s of %s left out (%s)", entry, user, exc)
            return False
        return True

    def _user_file(self, user: str) -> Path:
        # Any user name works as a file name this way, however it is spelled.
        return self._users / f"{hashlib.sha256(user.encode()).hexdigest()[:32]}.json"


def _read_names(path: Path) -> list[dict[str, str]]:
    try:
        names = json.loads(path.read_bytes())["programs"]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("installed programs: %s is unreadable, starting it afresh (%s)", path, exc)
        return []
    return list(names)
