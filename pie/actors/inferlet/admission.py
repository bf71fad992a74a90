"""What the inferlet actor admits: its limits ([sandbox] settings) and the fair queue of
instances waiting for a slot."""

from __future__ import annotations

import collections
from collections.abc import Mapping

from attrs import frozen


@frozen(kw_only=True)
class AdmissionLimits:
    """How many instances may exist and run ([sandbox] settings); 0 is no limit where noted."""

    max_concurrent: int = 64
    """Instances running at once."""
    max_per_user: int = 256
    """Instances of one user, running and queued together (0: no limit)."""
    max_running_per_user: int = 0
    """Instances of one user running at once (0: up to max_concurrent)."""
    max_children: int = 64
    """Children one instance may have at once, running and queued (0: no limit)."""
    max_depth: int = 8
    """Generations below an instance its client launched (0: no children at all)."""
    memory_cap: int = 1
    """The linear memory each running instance may use, reserved at admission."""
    memory_budget: int = 0
    """The memory all running instances may reserve together (0: no limit)."""
    max_session_messages: int = 1024
    """Session messages one instance may hold unread, queued or running (0: no limit)."""
    max_session_bytes: int = 16 << 20
    """Bytes of session messages one instance may hold unread (0: no limit)."""
    max_user_session_bytes: int = 64 << 20
    """Bytes of session messages one user's instances may hold unread together (0: no limit)."""


class FairQueue:
    """Instances waiting for a slot: one FIFO per user, and users take turns."""

    def __init__(self) -> None:
        # A dict keeps its users in turn order: the one just served goes to the back.
        self._users: dict[str, collections.deque[str]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, user: str, instance: str) -> None:
        self._users.setdefault(user, collections.deque()).append(instance)
        self._size += 1

    def remove(self, user: str, instance: str) -> None:
        waiting = self._users[user]
        waiting.remove(instance)
        self._size -= 1
        if not waiting:
            del self._users[user]

    def next_user(self, running: Mapping[str, int], most: int) -> str | None:
        """The waiting user with the fewest running (the earliest in turn among equals),
        skipping those with `most` running already (0: nobody is skipped)."""
        users = [u for u in self._users if most <= 0 or running.get(u, 0) < most]
        return min(users, key=lambda u: running.get(u, 0), default=None)

    def pop(self, user: str) -> str:
        """The user's oldest waiting instance; the user's next turn comes after everyone else's."""
        waiting = self._users.pop(user)
        self._size -= 1
        instance = waiting.popleft()
        if waiting:
            self._users[user] = waiting
        return instance
