"""The inferlet actor's pure core: the admission queue and each instance's lifecycle.

`handle(event)` returns the events to send; instances to start and to kill are left in
`to_start` / `to_kill` for the shell, which owns the threads. Launches past a user's, a
parent's or the family tree's limits are refused (`too_many_inferlets`); admission keeps
`max_concurrent` and the guests' memory budget, and a freed slot goes to the waiting user with
the fewest running. Session messages an instance holds unread are bounded per instance and user.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from attrs import define, field, frozen

from pie.actors.inferlet.admission import AdmissionLimits, FairQueue
from pie.actors.inferlet.programs import ProgramError, ProgramInfo, ProgramRegistry
from pie.events import inferlet as ev
from pie.events.kv import Done, RequestFailed
from pie.events.recording import HostCallsRecorded

Output = tuple[str, Any]


@frozen(kw_only=True)
class InferletStatistics:
    queued: int
    running: int
    launched: int
    returned: int
    failed: int
    terminated: int
    programs: int
    refused: int = 0
    """Launches refused for being over a limit (too_many_inferlets)."""
    session_bytes: int = 0
    """Bytes of session messages sent to instances that have not received them yet."""


@frozen(kw_only=True)
class InstanceListing:
    """One instance as an operator sees it (the dashboard); `state`: queued, running or
    stopping."""

    id: str
    user: str
    program: ProgramInfo
    state: str
    launcher: str
    depth: int


@define
class Instance:
    id: str
    launcher: str
    user: str
    program: ProgramInfo
    input: str
    request: ev.IncomingRequest | None = None
    depth: int = 0
    """0 for an instance a client launched, its parent's depth + 1 for a child."""
    state: str = "queued"
    detached: bool = False
    inbox: list[ev.SessionInput] = field(factory=list)
    """Messages sent while it was queued, delivered when it starts."""
    unread: int = 0
    """Session messages sent to it that its program has not received yet."""
    unread_bytes: int = 0

    @property
    def address(self) -> str:
        return f"inferlet:{self.id}"


class InferletCore:
    accepts = (
        ev.LaunchInferlet,
        ev.TerminateInferlet,
        ev.DetachInferlet,
        ev.SendToInferlet,
        ev.SessionReceived,
        ev.SessionMessage,
        ev.InferletOutput,
        ev.ResponseStarted,
        ev.ResponseBody,
        ev.InferletFinished,
        HostCallsRecorded,
    )
    """Commands from launchers, what running guests emit, and the shell's record of their ends;
    recorded host calls come only to be logged."""

    def __init__(self, programs: ProgramRegistry, limits: AdmissionLimits) -> None:
        self.programs = programs
        self.limits = limits
        self.instances: dict[str, Instance] = {}
        self.queue = FairQueue()
        self.to_start: list[Instance] = []
        self.to_kill: list[tuple[str, str]] = []
        self._ids = itertools.count(1)
        self._counts = collections.Counter[str]()
        self._per_user = collections.Counter[str]()
        self._running_per_user = collections.Counter[str]()
        self._per_launcher = collections.Counter[str]()
        self._unread_bytes = collections.Counter[str]()
        """Bytes of session messages each user's instances hold unread."""

    def handle(self, event: Any) -> list[Output]:
        match event:
            case ev.LaunchInferlet():
                return self._launch(event)
            case ev.TerminateInferlet():
                return self._terminate(event)
            case ev.DetachInferlet():
                return self._detach(event)
            case ev.SessionReceived():
                return self._received(event)
            case ev.SendToInferlet():
                return self._send(event)
            case (
                ev.SessionMessage() | ev.InferletOutput() | ev.ResponseStarted() | ev.ResponseBody()
            ):
                instance = self.instances.get(event.instance)
                return [(instance.launcher, event)] if instance else []
            case ev.InferletFinished():
                return self._finished(event)
            case HostCallsRecorded():
                return []
        raise TypeError(f"inferlet actor got an unexpected event {type(event).__name__}")

    def _launch(self, event: ev.LaunchInferlet) -> list[Output]:
        try:
            program = self.programs.resolve(event.program, event.user)
        except ProgramError as err:
            return [(event.requester, _failed(event.corr, "no_such_program", str(err)))]
        parent = self._parent(event.requester)
        refusal = self._refusal(event, parent)
        if refusal is not None:
            self._counts["refused"] += 1
            return [(event.requester, _failed(event.corr, "too_many_inferlets", refusal))]
        instance = Instance(
            id=f"i{next(self._ids)}",
            launcher=event.requester,
            user=event.user,
            program=program.info,
            input=event.input,
            request=event.request,
            depth=0 if parent is None else parent.depth + 1,
        )
        self.instances[instance.id] = instance
        self._per_user[instance.user] += 1
        self._per_launcher[instance.launcher] += 1
        self.queue.append(instance.user, instance.id)
        self._counts["launched"] += 1
        admitted = self._admit()
        queued = instance.state == "queued"
        launched = ev.InferletLaunched(corr=event.corr, instance=instance.id, queued=queued)
        return [(event.requester, launched), *admitted]

    def _parent(self, requester: str) -> Instance | None:
        kind, _, name = requester.partition(":")
        return self.instances.get(name) if kind == "inferlet" else None

    def _refusal(self, event: ev.LaunchInferlet, parent: Instance | None) -> str | None:
        """Why the launch is over a limit, or None."""
        limits = self.limits
        if 0 < limits.max_per_user <= self._per_user[event.user]:
            return (
                f"user {event.user!r} already has {limits.max_per_user} inferlets running or "
                "queued (sandbox.max_inferlets_per_user)"
            )
        if parent is None:
            return None
        if parent.depth >= limits.max_depth:
            return (
                f"inferlet {parent.id} is {parent.depth} launches below its client; children may "
                f"go {limits.max_depth} deep (sandbox.max_child_depth)"
            )
        if 0 < limits.max_children <= self._per_launcher[event.requester]:
            return (
                f"inferlet {parent.id} already has {limits.max_children} children running or "
                "queued (sandbox.max_children)"
            )
        return None

    def _has_room(self) -> bool:
        limits = self.limits
        running = self.running
        if running >= limits.max_concurrent:
            return False
        reserved = (running + 1) * limits.memory_cap
        return limits.memory_budget <= 0 or reserved <= limits.memory_budget

    def _admit(self) -> list[Output]:
        out: list[Output] = []
        while self._has_room():
            user = self.queue.next_user(self._running_per_user, self.limits.max_running_per_user)
            if user is None:
                break
            instance = self.instances[self.queue.pop(user)]
            instance.state = "running"
            self._running_per_user[user] += 1
            self.to_start.append(instance)
            started = ev.InferletStarted(instance=instance.id, program=instance.program.hash)
            out.append((instance.launcher, started))
            out.extend((instance.address, message) for message in instance.inbox)
            instance.inbox.clear()
        return out

    def _terminate(self, event: ev.TerminateInferlet) -> list[Output]:
        instance = self._own(event.instance, event.requester)
        if isinstance(instance, RequestFailed):
            return [(event.requester, _with_corr(instance, event.corr))]
        out: list[Output] = [(event.requester, Done(corr=event.corr))]
        if instance.state == "queued":
            self.queue.remove(instance.user, instance.id)
            out.extend(
                self._end(
                    instance,
                    ev.InferletTerminated(
                        instance=instance.id, reason=f"terminated by {event.requester}", seconds=0.0
                    ),
                )
            )
        elif instance.state == "running":
            instance.state = "stopping"
            self.to_kill.append((instance.id, f"terminated by {event.requester}"))
        return out

    def _detach(self, event: ev.DetachInferlet) -> list[Output]:
        instance = self._own(event.instance, event.requester)
        if isinstance(instance, RequestFailed):
            return [(event.requester, _with_corr(instance, event.corr))]
        instance.detached = True
        return [(event.requester, Done(corr=event.corr))]

    def _send(self, event: ev.SendToInferlet) -> list[Output]:
        instance = self._own(event.instance, event.requester)
        if isinstance(instance, RequestFailed):
            return [(event.requester, _with_corr(instance, event.corr))]
        size = ev.session_size(event.text, event.data)
        refusal = self._session_refusal(instance, size)
        if refusal is not None:
            return [(event.requester, _failed(event.corr, *refusal))]
        instance.unread += 1
        instance.unread_bytes += size
        self._unread_bytes[instance.user] += size
        message = ev.SessionInput(instance=instance.id, text=event.text, data=event.data)
        out: list[Output] = [(event.requester, Done(corr=event.corr))]
        if instance.state == "queued":
            instance.inbox.append(message)
        else:
            out.append((instance.address, message))
        return out

    def _session_refusal(self, instance: Instance, size: int) -> tuple[str, str] | None:
        """(kind, message) when a session message of `size` bytes would take the instance or
        its user over a bound; None when it fits."""
        limits = self.limits
        held = f"inferlet {instance.id} holds {instance.unread} messages it has not received"
        if limits.max_session_messages and instance.unread >= limits.max_session_messages:
            return "overrun", f"{held} ([sandbox] max_session_messages)"
        if limits.max_session_bytes and instance.unread_bytes + size > limits.max_session_bytes:
            return "overrun", (
                f"{held}, {instance.unread_bytes} bytes; {size} more would pass [sandbox] "
                "max_session_mb"
            )
        used = self._unread_bytes[instance.user]
        if limits.max_user_session_bytes and used + size > limits.max_user_session_bytes:
            return "quota", (
                f"user {instance.user!r}'s inferlets hold {used} bytes of messages they have not "
                f"received; {size} more would pass [sandbox] max_user_session_mb"
            )
        return None

    def _received(self, event: ev.SessionReceived) -> list[Output]:
        instance = self.instances.get(event.instance)
        if instance is not None and instance.unread:
            instance.unread -= 1
            self._release_unread(instance, min(event.size, instance.unread_bytes))
        return []

    def _release_unread(self, instance: Instance, size: int) -> None:
        instance.unread_bytes -= size
        _forget(self._unread_bytes, instance.user, size)

    def _finished(self, event: ev.InferletFinished) -> list[Output]:
        instance = self.instances.get(event.instance)
        if instance is None:
            return []
        end: ev.InferletEnd
        if event.status == "returned":
            end = ev.InferletReturned(
                instance=instance.id, result=event.result or "", seconds=event.seconds
            )
        elif event.status == "killed":
            end = ev.InferletTerminated(
                instance=instance.id, reason=event.error or "killed", seconds=event.seconds
            )
        else:
            end = ev.InferletFailed(
                instance=instance.id,
                status=event.status,
                error=event.error or event.status,
                seconds=event.seconds,
            )
        return [*self._end(instance, end), *self._admit()]

    def _end(self, instance: Instance, end: ev.InferletEnd) -> list[Output]:
        del self.instances[instance.id]
        if instance.unread_bytes:
            self._release_unread(instance, instance.unread_bytes)
        _forget(self._per_user, instance.user)
        if instance.state != "queued":
            _forget(self._running_per_user, instance.user)
        _forget(self._per_launcher, instance.launcher)
        self._counts[type(end).__name__] += 1
        out: list[Output] = [(instance.launcher, end)]
        for child in list(self.instances.values()):
            if (
                child.launcher == instance.address
                and child.id in self.instances
                and not child.detached
            ):
                out.extend(self._stop_child(child, f"its parent {instance.id} ended"))
        return out

    def _stop_child(self, child: Instance, reason: str) -> list[Output]:
        if child.state == "queued":
            self.queue.remove(child.user, child.id)
            return self._end(
                child, ev.InferletTerminated(instance=child.id, reason=reason, seconds=0.0)
            )
        if child.state == "running":
            child.state = "stopping"
            self.to_kill.append((child.id, reason))
        return []

    def _own(self, instance_id: str, requester: str) -> Instance | RequestFailed:
        instance = self.instances.get(instance_id)
        if instance is None:
            return _failed(0, "no_such_inferlet", f"no running inferlet {instance_id!r}")
        if instance.launcher != requester:
            return _failed(0, "not_owner", f"inferlet {instance_id} was launched by another")
        return instance

    def stop_all(self, reason: str) -> list[Output]:
        """Engine shutdown: queued instances end now, running ones are killed."""
        out: list[Output] = []
        for instance in list(self.instances.values()):
            out.extend(self._stop_child(instance, reason))
        return out

    def listing(self) -> tuple[InstanceListing, ...]:
        """Every instance, queued ones included, oldest first."""
        return tuple(
            InstanceListing(
                id=i.id,
                user=i.user,
                program=i.program,
                state=i.state,
                launcher=i.launcher,
                depth=i.depth,
            )
            for i in self.instances.values()
        )

    @property
    def running(self) -> int:
        return sum(1 for i in self.instances.values() if i.state != "queued")

    def statistics(self) -> InferletStatistics:
        return InferletStatistics(
            queued=len(self.queue),
            running=self.running,
            launched=self._counts["launched"],
            returned=self._counts["InferletReturned"],
            failed=self._counts["InferletFailed"],
            terminated=self._counts["InferletTerminated"],
            programs=len(self.programs),
            refused=self._counts["refused"],
            session_bytes=sum(self._unread_bytes.values()),
        )


def _forget(counts: collections.Counter[str], key: str, amount: int = 1) -> None:
    counts[key] -= amount
    if counts[key] <= 0:
        del counts[key]


def _failed(corr: int, kind: str, message: str) -> RequestFailed:
    return RequestFailed(corr=corr, kind=kind, message=message)


def _with_corr(failed: RequestFailed, corr: int) -> RequestFailed:
    return RequestFailed(corr=corr, kind=failed.kind, message=failed.message)
